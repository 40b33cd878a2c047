"""In-memory snapshots: the run's state copied into host memory (a tmpfs) at step boundaries, replicated to
another node, and recovered from after a restart (`checkpoint.snapshot_every_steps`, `checkpoint.snapshot_dir`).

A closed sub-system: the `CheckpointManager` (checkpoint/manager.py) uses it only through the names below.

- `MemorySnapshots` (`store.py`): per rank, `due(step)`, `snapshot(...)` in the background, `start`, `finish`;
- `snapshot_files` and `LiveState` (`live_state.py`): what a snapshot holds, from cheap state dicts;
- `recover` → `MemoryChoice` (`recover.py`): the newest snapshot every rank's part is held for, rebuilt into a
  committed checkpoint folder that the manager loads as it loads one from disk.

Inside: `flat.py` (tensors copied straight into mapped tmpfs files), `folder.py` (the folder's layout, parts,
clean-up), `rebuild.py` (a snapshot's files turned back into checkpoint files), `replica.py` (the copy sent to
another node), `pace.py` (room and time the default may spend).
"""

from dptrain.checkpoint.snapshots.live_state import LiveState, snapshot_files
from dptrain.checkpoint.snapshots.recover import MemoryChoice, recover
from dptrain.checkpoint.snapshots.store import MemorySnapshots

__all__ = ["LiveState", "MemoryChoice", "MemorySnapshots", "recover", "snapshot_files"]
