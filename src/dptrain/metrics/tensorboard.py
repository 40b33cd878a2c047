"""TensorBoard scalars (`log.tensorboard=true`): rank 0 writes every numeric key of every log record
to RUN_DIR/tensorboard/ with torch.utils.tensorboard's SummaryWriter, at the record's step.

The tag is the record key itself (`loss`, `lr`, `tokens_per_s`, `val_loss`, ...), so a value in
TensorBoard and the same key in metrics.jsonl are one number (stored as float32 by TensorBoard).
Events are flushed every few seconds, so a running job can be watched: `tensorboard --logdir RUN_DIR`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FLUSH_S = 5


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=FLUSH_S)

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step)

    def close(self, *, finished: bool = True) -> None:
        self.writer.close()
