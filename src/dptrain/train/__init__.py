"""The training step and what it needs on every rank: `Trainer` (trainer.py: the loop, `train_step`,
`end_step`), the loss rule (loss.py), optimizer and schedule (optim.py), precision (autocast and the
loss scaler), evaluation, the step counters (state.py), the run's outputs (outputs.py), factories
by import path (build.py) and process-wide backend switches (backend.py)."""
