"""Where a run's records go, on every rank: the console (rank 0's banner, progress line and messages;
a finding goes to stderr when the progress display is off), metrics.jsonl (rank 0), the monitoring
sinks (metrics/monitor.py: each rank gets its own record), summary.json and the consolidated
`final/` weights (rank 0). The trainer owns one `RunOutputs`; what the records say is built by
metrics/records.py, when they are written is the trainer's step boundary.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dptrain import __version__
from dptrain.checkpoint.adapters import adapter_state, save_adapters
from dptrain.checkpoint.hf import save_pretrained_config
from dptrain.checkpoint.storage import save_safetensors
from dptrain.metrics import strict_json
from dptrain.metrics.monitor import Monitor, build_monitor
from dptrain.metrics.sinks import ConsoleSink, JsonlSink, print_summary
from dptrain.models import lora
from dptrain.parallel import unwrap

if TYPE_CHECKING:
    import torch

    from dptrain.config import LogConfig, Resolved
    from dptrain.diagnostics import Diagnostics
    from dptrain.distributed.env import DistEnv
    from dptrain.parallel import ParallelModel


class RunOutputs:
    """The run's sinks. Idle until `open` (the trainer's `setup`); `say` works before that too."""

    def __init__(self, *, env: DistEnv, run_dir: Path) -> None:
        self.env = env
        self.run_dir = run_dir
        self.jsonl: JsonlSink | None = None
        self.console: ConsoleSink | None = None
        self.monitor: Monitor | None = None

    def open(
        self, *, log: LogConfig, max_steps: int, res: Resolved, strategy: str, precision: str,
        device: torch.device, diag: Diagnostics,
    ) -> None:
        """Console and monitoring sinks on every rank; on rank 0 the run directory, metrics.jsonl and
        the banner (layout, batch arithmetic, run directory, the rendezvous store's exposure)."""
        self.console = ConsoleSink(max_steps=max_steps, enabled=self.env.is_main and log.progress)
        # TensorBoard (rank 0), Prometheus and the status file for `dptrain top` (every rank): metrics/monitor.py
        self.monitor = build_monitor(log, env=self.env, run_dir=self.run_dir, device=device, diag=diag)
        if not self.env.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = JsonlSink(self.run_dir / "metrics.jsonl")
        self.console.message(
            f"dptrain {__version__}: strategy={strategy} world_size={res.world_size} "
            f"device={device.type} backend={res.backend} precision={precision}\n"
            f"layout: {res.dims.describe()}\n"
            f"batch: global {res.global_batch_size} = micro {res.micro_batch_size} x accum "
            f"{res.grad_accum_steps} x dp {res.dp_world_size}; {res.lr_rule}\n"
            + (f"pipeline: {res.pipeline}\n" if res.pipeline else "")
            + f"run dir: {self.run_dir}"
        )
        if self.env.launched:
            self.console.message(
                f"rendezvous store: {self.env.master_addr}:{self.env.master_port} (torch.distributed's TCPStore is "
                "unauthenticated and listens on all interfaces: keep it on a trusted network)"
            )

    def say(self, text: str) -> None:
        """A diagnostics finding: on the console, or on stderr when the progress display is off."""
        if self.console is not None and self.console.enabled:
            self.console.message(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def log(self, record: dict[str, Any]) -> None:
        """A record: metrics.jsonl (rank 0), the progress line, and every rank's monitoring sinks."""
        if self.jsonl is not None:
            self.jsonl.write(record)
        assert self.console is not None and self.monitor is not None, "RunOutputs.log before open"
        self.console.write(record)
        self.monitor.write(record)  # every rank: its own step time and throughput

    def log_eval(self, *, step: int, val: float, bpb: float | None, metrics: dict[str, float] | None = None) -> None:
        """An evaluation: its record and a console line (train.eval_fn's metrics as `eval_NAME`)."""
        extra = {f"eval_{k}": v for k, v in (metrics or {}).items()}
        self.log({"step": step, "val_loss": val, **({"val_bpb": bpb} if bpb else {}), **extra})
        assert self.console is not None
        self.console.message(f"step {step}: val loss {val:.4f}" + (f"  ({bpb:.3f} bits/byte)" if bpb else "")
                             + "".join(f"  {k} {v:.4f}" for k, v in extra.items()))

    def save_final(self, pmodel: ParallelModel) -> None:
        """Consolidated weights under the plain module's names, whatever the strategy; for a Hugging Face
        model also its config, so that final/ loads with `from_pretrained` (checkpoint/hf.py). A PEFT model (LoRA):
        PEFT's adapter_model.safetensors + adapter_config.json (checkpoint/adapters.py)."""

        if lora.is_peft_model(unwrap(pmodel.module)):  # LoRA: PEFT's adapter files, the base never gathered
            adapters = adapter_state(pmodel.module)  # collective under FSDP: every rank calls it
            if self.env.is_main:
                save_adapters(pmodel.module, adapters, self.run_dir / "final")
            return
        state = pmodel.full_state_dict()  # collective under FSDP: every rank calls it
        if self.env.is_main:
            save_safetensors(state, self.run_dir / "final" / "model.safetensors")
            save_pretrained_config(unwrap(pmodel.module), state, self.run_dir / "final")  # HF models: + config.json

    def close(self, *, finished: bool) -> None:
        """Stop the monitoring sinks (their threads and servers); `finished`: the run completed."""
        if self.monitor is not None:
            self.monitor.close(finished=finished)

    def finish(self, summary: dict[str, Any], *, progress: bool) -> None:
        """Rank 0: summary.json, the progress line closed, the summary table when progress is shown."""
        if not self.env.is_main:
            return
        (self.run_dir / "summary.json").write_text(strict_json.dumps(summary, indent=2) + "\n")
        assert self.console is not None
        self.console.close()
        if progress:
            print_summary(summary, run_dir=self.run_dir)
