"""Where a fine-tuning step's host memory peaks, measured inside the ranks: RSS per phase of the step.

    python benchmarks/memory/finetune_memory_phases.py --model DIR [--nproc 2] [--lora] [--optimizer adamw|sgd]
        [--steps 2] [--set KEY=VALUE ...]

`DIR` is a Hugging Face Llama folder (e.g. the one `benchmarks/memory/finetune_memory.py --keep W` saves as
W/model). The ranks are forked from this process (tests/support/mp.py's harness: a real gloo group with torchrun's
environment) and each builds the Trainer as `dptrain run` does (`dptrain.models.hf:causal_lm`, fsdp, the same
overrides as finetune_memory.py) and runs `end_step(train_step())`. A thread samples this rank's RSS
(/proc/self/statm) every 2 ms and charges each sample to the step's current place: the Trainer's phases (data,
forward, backward, optimizer) refined by module hooks: a module's forward (`fwd NAME`, with FSDP2's all-gather of
its unit) from its pre-hook to its hook, and its backward (`bwd NAME`) from the moment the gradient reaches its
output. It prints, per rank, the RSS after setup and the peak of each place, largest first. """

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Places(threading.Thread):
    """The peak RSS seen while each place was current."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.place = "setup"
        self.peaks: dict[str, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            now, place = rss(), self.place
            if now > self.peaks.get(place, 0):
                self.peaks[place] = now
            time.sleep(0.002)


def watch(model: Any, places: Places) -> None:
    """Label forward and backward of the decoder layers, the embeddings, the final norm and lm_head."""
    import torch

    def output_tensor(out: Any) -> Any:
        out = getattr(out, "last_hidden_state", out)
        return out[0] if isinstance(out, tuple) else out

    for name, module in model.named_modules():
        short = name.replace("base_model.model.", "").replace("_fsdp_wrapped_module.", "")
        parts = short.split(".")
        layer = len(parts) == 3 and parts[1] == "layers"
        if not (short.endswith(("embed_tokens", "lm_head", "model.norm")) or layer):
            continue

        def pre(_m: Any, _a: Any, *, label: str = short) -> None:
            places.place = f"fwd {label}"

        def post(_m: Any, _a: Any, out: Any, *, label: str = short) -> None:
            places.place = "forward"
            t = output_tensor(out)
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, label=label: setattr(places, "place", f"bwd {label}"))

        module.register_forward_pre_hook(pre, prepend=True)  # before FSDP2's all-gather: charged to NAME
        module.register_forward_hook(post)


def job(rank: int, items: list[str], steps: int) -> dict[str, Any]:
    places = Places()
    places.start()
    from dptrain.config.load import load_config
    from dptrain.distributed.process_group import process_group
    from dptrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, items), out_dir=tempfile.mkdtemp(prefix="dptrain-phases-"))
    with process_group(trainer.env, backend=trainer.res.backend, device=trainer.device, timeout_s=600):
        trainer.setup()
        after_setup = rss()
        watch(trainer.parallel.plain, places)
        phase = trainer.diag.phase

        def labelled(name: str, **kw: Any) -> None:
            places.place = name
            phase(name, **kw)

        trainer.diag.phase = labelled  # type: ignore[method-assign]
        for _ in range(steps):
            trainer.end_step(trainer.train_step())
            places.place = "end_step"
        places.done.set()
        trainer.close()
        trainer.model = trainer.parallel.release()
        trainer.mesh.release()
    return {"after_setup": after_setup, "peaks": places.peaks}


def main(argv: list[str]) -> int:
    from finetune_memory import LORA_RANK, LORA_TARGETS, write_sft

    from support.mp import run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    n = a.nproc
    with tempfile.TemporaryDirectory(prefix="phases-") as tmp:
        data = Path(tmp) / "sft.jsonl"
        write_sft(data)
        items = ["parallel.strategy=fsdp", "parallel.device=cpu", f"train.max_steps={a.steps}",
                 f"train.global_batch_size={n}", "train.micro_batch_size=1", "train.log_every_steps=1",
                 "train.eval_every_steps=0", f"optim.name={a.optimizer}", "optim.warmup_steps=0", "optim.lr=1e-4",
                 "log.progress=false", f"data.source={data}",
                 f"data.kwargs={{seq_len: 64, max_tokens: 1024, min_rows: {n}}}", "data.num_workers=0",
                 "model.factory=dptrain.models.hf:causal_lm", f"model.kwargs.pretrained={a.model}",
                 "parallel.activation_checkpointing=full", "checkpoint.every_steps=0"]
        if a.lora:
            items += ["model.lora.enabled=true", f"model.lora.rank={LORA_RANK}", f"model.lora.alpha={2 * LORA_RANK}",
                      f"model.lora.target_modules=[{','.join(LORA_TARGETS)}]"]
        results = run_ranks(job, n, [*items, *a.set], a.steps, timeout=3000)
    for rank, r in enumerate(results):
        print(f"\nrank {rank}: {r['after_setup'] / 1e9:.2f} GB after setup")
        print("| place | peak RSS (GB) |\n|---|---:|")
        for place, peak in sorted(r["peaks"].items(), key=lambda kv: -kv[1])[:a.top]:
            print(f"| {place} | {peak / 1e9:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
