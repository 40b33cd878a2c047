"""Peak host memory per rank of fine-tuning a locally saved Hugging Face Llama with `dptrain run`.

    python benchmarks/memory/finetune_memory.py --params 2.26e8 --nproc 2 4 [--lora] [--optimizer adamw|sgd]
        [--factory eager | IMPORT.PATH:FN] [--steps 2] [--set KEY=VALUE ...]

What a user does, measured from outside:

1. a Llama of about ``--params`` parameters (vocabulary 32000; hidden size, FFN width and layer count chosen to
   hit it) with random weights from a ``LlamaConfig``, ``save_pretrained`` into a temporary folder (fp32
   safetensors), in a child process that exits before anything is measured; and a small SFT JSONL file
   (the ``bytes`` tokenizer: nothing downloaded);
2. ``dptrain run`` (the real CLI, a subprocess) with ``--nproc-per-node N``, ``parallel.strategy=fsdp``, for
   ``--steps`` steps, full fine-tuning or LoRA (``--lora``: rank 8 on q/k/v/o);
3. the RSS of EVERY process of the run (the launcher, torchrun's workers, anything they start) sampled with
   psutil every 0.1 s; each worker is told by its ``RANK``.

``--factory eager`` (default) is the user-style factory a user writes today: ``from_pretrained`` on every rank
(with ``--lora`` it wraps the model with PEFT's ``get_peft_model`` itself). Any other value is an import path
given ``model.kwargs.pretrained=DIR`` (e.g. ``dptrain.models.hf:causal_lm``, sharded loading); with ``--lora``
it is given ``model.lora.rank=8`` (``--lora-via factory|config`` chooses; ``--set`` passes any other override).

It prints a markdown table per world size: per rank the peak RSS while loading and training (until the last
step's record), the peak over the whole run (with the final save: rank 0 gathers the full weights), and the
target of issue 38: this rank's share of the training state (1/world of the parameters, and of the gradients
and optimizer state of what is trained) + the same run's peak on a tiny model + one largest tensor, + 20%.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 32000
LORA_RANK = 8
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
FACTORIES = textwrap.dedent(f'''
    """User-style factories of benchmarks/memory/finetune_memory.py: what a user writes today."""
    import torch
    from transformers import AutoModelForCausalLM


    def causal_lm(path: str):
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)


    def peft_causal_lm(path: str, rank: int = {LORA_RANK}):
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules={list(LORA_TARGETS)!r})
        return get_peft_model(causal_lm(path), lora)
''')
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards box jugs of gold".split()


def llama_shape(params: float) -> dict[str, int]:
    """A Llama config (Llama-2-like proportions, vocabulary 32000, untied head) of about `params` parameters."""
    small = params < 2e7  # smoke tests: the bytes' vocabulary and a narrow model
    vocab = 256 if small else VOCAB
    hidden = 64 if small else 1024 if params < 4e8 else 1536 if params < 8e8 else 2048 if params < 3e9 else 4096
    ffn = int(math.ceil(8 * hidden / 3 / 64) * 64)
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden
    layers = max(1, round((params - 2 * vocab * hidden - hidden) / per_layer))
    return {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 64}


@dataclass(frozen=True)
class Sizes:
    params: int  # all parameters
    trained: int  # those with requires_grad
    largest_bytes: int  # the largest single tensor


def model_sizes(shape: dict[str, int], *, lora: bool) -> Sizes:
    """Counted on the meta device (no memory): the saved model, and what LoRA r=8 on q/k/v/o trains."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    total = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    trained = total
    if lora:  # r * (in + out) per targeted Linear
        trained = sum(LORA_RANK * (m.in_features + m.out_features) for name, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGETS)
        total += trained
    return Sizes(params=total, trained=trained, largest_bytes=largest)


def save_model(shape: dict[str, int], folder: Path) -> None:
    """Random weights saved with save_pretrained, in a child process (its memory is gone before the run)."""
    code = ("import json, sys, torch, transformers; torch.manual_seed(0); "
            "m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**json.loads(sys.argv[1]), "
            "bos_token_id=None, eos_token_id=0, pad_token_id=0)); m.save_pretrained(sys.argv[2])")
    r = subprocess.run([sys.executable, "-c", code, json.dumps(shape), str(folder)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"saving the model failed:\n{r.stderr[-3000:]}")


def write_sft(path: Path, n: int = 64) -> None:
    import random

    r = random.Random(0)
    lines = [json.dumps({"prompt": " ".join(r.choices(WORDS, k=r.randint(3, 12))) + " ?",
                         "response": " " + " ".join(r.choices(WORDS, k=r.randint(3, 12)))}) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")


class Sampler(threading.Thread):
    """Every 0.1 s: the RSS of `root` and all its descendants; the peak per process (keyed by RANK, or
    'launcher'/'other'), the peak of their sum, and the same until `marker` holds `until`."""

    def __init__(self, root: int, *, marker: Path, until: str, limit: float | None = None) -> None:
        super().__init__(daemon=True)
        self.root, self.marker, self.until, self.limit = root, marker, until, limit
        self.killed = False
        self.peak: dict[str, int] = {}
        self.peak_training: dict[str, int] = {}
        self.total = self.total_training = 0
        self.labels: dict[int, str] = {}
        self.done = threading.Event()

    def _label(self, p: psutil.Process) -> str:
        if p.pid not in self.labels:
            try:
                rank = p.environ().get("RANK")
            except (psutil.Error, OSError):
                rank = None
            label = "launcher" if p.pid == self.root else f"rank {rank}" if rank is not None else None
            if label is None:  # not known yet (a worker still starting): asked again at the next sample
                return f"other {p.pid}"
            self.labels[p.pid] = label
        return self.labels[p.pid]

    def _trained(self) -> bool:
        try:
            return self.until in self.marker.read_text()
        except OSError:
            return False

    def run(self) -> None:
        root = psutil.Process(self.root)
        while not self.done.is_set():
            training = not self._trained()
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            now: dict[str, int] = {}
            for p in procs:
                try:
                    name = self._label(p)
                    now[name] = now.get(name, 0) + p.memory_info().rss
                except psutil.Error:
                    continue
            for name, rss in now.items():
                self.peak[name] = max(self.peak.get(name, 0), rss)
                if training:
                    self.peak_training[name] = max(self.peak_training.get(name, 0), rss)
            self.total = max(self.total, sum(now.values()))
            if self.limit is not None and sum(now.values()) > self.limit:  # a shared machine: before the OOM killer
                self.killed = True
                for p in reversed(procs):
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
                break
            if training:
                self.total_training = self.total
            self.done.wait(0.1)


def run_once(a: argparse.Namespace, *, model: Path, data: Path, work: Path, nproc: int, tag: str) -> Sampler:
    """`dptrain run` on `model` with `nproc` workers, sampled; its output is kept in work/tag.log."""
    out = work / f"run-{tag}"
    shutil.rmtree(out, ignore_errors=True)  # a finished run there would only be reported, not run again
    over = ["parallel.strategy=fsdp", "parallel.device=cpu", f"train.max_steps={a.steps}",
            f"train.global_batch_size={nproc}", "train.micro_batch_size=1", "train.log_every_steps=1",
            "train.eval_every_steps=0", f"optim.name={a.optimizer}", "optim.warmup_steps=0", "optim.lr=1e-4",
            "log.progress=false", f"data.source={data}", f"data.kwargs={{seq_len: 64, max_tokens: 1024, min_rows: "
            f"{nproc}}}", "data.num_workers=0"]
    if a.factory == "eager":
        via_factory = a.lora and a.lora_via != "config"
        over += [f"model.factory=bench_factories:{'peft_causal_lm' if via_factory else 'causal_lm'}",
                 f"model.kwargs.path={model}"]
    else:
        via_factory = False
        over += [f"model.factory={a.factory}", f"model.kwargs.pretrained={model}"]
    if a.lora and not via_factory:
        over += ["model.lora.enabled=true", f"model.lora.rank={LORA_RANK}", f"model.lora.alpha={2 * LORA_RANK}",
                 f"model.lora.target_modules=[{','.join(LORA_TARGETS)}]"]  # the `model.lora` section
    over += a.set
    path = os.pathsep.join([str(work), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dptrain", "run", *over, "--nproc-per-node", str(nproc), "--out", str(out)]
    with open(work / f"{tag}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
        sampler = Sampler(proc.pid, marker=out / "metrics.jsonl", until=f'"step": {a.steps},',
                          limit=a.rss_limit_gb * 1e9 if a.rss_limit_gb else None)
        sampler.start()
        rc = proc.wait()
        sampler.done.set()
        sampler.join()
    if sampler.killed:
        message = (f"dptrain run ({tag}) stopped: all its processes together held more than --rss-limit-gb "
                   f"{a.rss_limit_gb} GB")
        if not sampler._trained():  # before the training steps were done: nothing to report
            raise SystemExit(message)
        print(f"{message} after its {a.steps} steps (in the final save): the whole-run column stops there")
    elif rc != 0:
        tail = (work / f"{tag}.log").read_text()[-4000:]
        raise SystemExit(f"dptrain run ({tag}) exited {rc}: {' '.join(cmd)}\n{tail}")
    return sampler


def state_share(s: Sizes, *, world: int, optimizer: str) -> int:
    """Bytes of this rank's share of the training state (fp32): the parameters, and the gradients and the
    optimizer state of what is trained (AdamW: two moments; SGD without momentum: none), 1/world each."""
    opt = 8 if optimizer == "adamw" else 0
    return (4 * s.params + (4 + opt) * s.trained) // world


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=2.26e8, help="approximate size of the model (e.g. 1e9)")
    p.add_argument("--nproc", type=int, nargs="+", default=[2], help="world sizes to run (e.g. 2 4)")
    p.add_argument("--lora", action="store_true", help=f"LoRA rank {LORA_RANK} on {', '.join(LORA_TARGETS)}")
    p.add_argument("--lora-via", choices=["auto", "factory", "config"], default="auto",
                   help="with --factory eager, LoRA by the user's PEFT factory (auto) or by model.lora (config)")
    p.add_argument("--factory", default="eager",
                   help="eager: the user's from_pretrained factory; else an import path given model.kwargs.pretrained")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another override for dptrain run")
    p.add_argument("--rss-limit-gb", type=float, help="kill the run when all its processes together hold more")
    p.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one)")
    a = p.parse_args(argv)
    shape, tiny = llama_shape(a.params), llama_shape(0)  # tiny: one layer of width 64 over 256 ids
    sizes = model_sizes(shape, lora=a.lora)
    with tempfile.TemporaryDirectory(prefix="finetune-memory-") as tmp:
        work = a.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        (work / "bench_factories.py").write_text(FACTORIES)
        write_sft(work / "sft.jsonl")
        save_model(shape, work / "model")
        save_model(tiny, work / "tiny")
        disk = sum(f.stat().st_size for f in (work / "model").glob("*.safetensors"))
        mode = f"LoRA r={LORA_RANK}" if a.lora else "full fine-tuning"
        print(f"model: LlamaForCausalLM {shape}, {sizes.params / 1e6:.1f}M parameters ({sizes.trained / 1e6:.2f}M "
              f"trained), {gb(disk)} GB of safetensors, largest tensor {gb(sizes.largest_bytes)} GB; {mode}, "
              f"{a.optimizer}, fsdp, {a.steps} steps, factory {a.factory}")
        print(f"command: python benchmarks/memory/finetune_memory.py {' '.join(argv)}")
        for n in a.nproc:
            t0 = time.perf_counter()
            small = run_once(a, model=work / "tiny", data=work / "sft.jsonl", work=work, nproc=n, tag=f"tiny-{n}")
            big = run_once(a, model=work / "model", data=work / "sft.jsonl", work=work, nproc=n, tag=f"model-{n}")
            share = state_share(sizes, world=n, optimizer=a.optimizer)
            print(f"\n{n} ranks ({time.perf_counter() - t0:.0f} s): peak of the sum over all processes "
                  f"{gb(big.total_training)} GB training, {gb(big.total)} GB with the final save\n")
            print("| process | peak RSS, load + train (GB) | peak RSS, whole run (GB) | tiny model (GB) | state share "
                  "(GB) | target (GB) | within target |")
            print("|---|---:|---:|---:|---:|---:|---|")
            for name in sorted(big.peak, key=lambda k: (not k.startswith("rank"), k)):
                tiny_rss = small.peak_training.get(name, 0)
                row = f"| {name} | {gb(big.peak_training.get(name, 0))} | {gb(big.peak[name])} | {gb(tiny_rss)} |"
                if name.startswith("rank"):
                    target = 1.2 * (share + tiny_rss + sizes.largest_bytes)
                    ok = big.peak_training.get(name, 0) <= target
                    row += f" {gb(share)} | {gb(target)} | {'yes' if ok else 'no'} |"
                else:
                    row += " | | |"
                print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
