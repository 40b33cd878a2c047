"""Faults for benchmarks/acceptance/fault_matrix.py: loss and data factories, and an own loop, that misbehave on
one rank.

Every fault is chosen by environment variables that torchrun passes on to its workers:

- `FAULT_RANK`: the rank that misbehaves (the culprit);
- `FAULT_STEP`: the optimizer step (1-based) at which it does;
- `FAULT_MARK`: a file the culprit writes `time.time()` into at the moment of the fault (the injection time).

The run's recipe (fault_matrix.BASE) takes one micro-batch per optimizer step, so the n-th training call of the
loss is step n.
"""
