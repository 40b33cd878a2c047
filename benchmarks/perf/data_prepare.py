"""`dptrain data prepare` throughput, and the memory of packed rows over corpora of 1x, 4x and 16x one size.

    python benchmarks/perf/data_prepare.py [--docs 20000] [--workers 1 2] [--rss-mib 16] [--rows 3000] [--only WHICH]

1. Throughput: `--docs` JSON-lines documents (50-400 words each, made here), a byte-level BPE of
   vocabulary 8,000 trained on them with `tokenizers`, prepared with each `--workers` count (a fresh
   output folder each time); tokens/s is the prepare's own count over its wall time (planning and the
   pool's start included).
2. Memory: corpora of `--rss-mib` MiB of tokens x 1, 4 and 16 (the bytes tokenizer, so the token count
   is the text size), each read in a fresh process: `build_packed` (SHA-256 verification of every shard
   included), then `--rows` rows at random through a DataLoader with 2 workers; the peak RSS of that
   process and of its workers (ru_maxrss) is printed.

Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("data parallel training splits every global batch over ranks and averages the gradients so each "
         "replica applies the same update while the order of samples never depends on how many ranks there "
         "are tokenizer shard manifest memory mapped packed rows documents boundaries").split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) + ("." if r.random() < 0.1 else "") for _ in range(r.randint(50, 400)))
            for _ in range(n)]


def throughput(tmp: Path, n_docs: int, workers: list[int]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dptrain.data.prepare import prepare

    docs = make_docs(n_docs)
    src = tmp / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs[:2000], trainers.BpeTrainer(vocab_size=8000, special_tokens=["<|endoftext|>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp / "tokenizer.json"))
    for w in workers:
        out = tmp / f"prep-{w}"
        stats = prepare([str(src)], tokenizer=str(tmp / "tokenizer.json"), out=out, workers=w,
                        shard_docs=max(1, n_docs // 16))
        print(json.dumps({"what": "prepare", "workers": w, "processes": stats.workers, "docs": stats.n_docs,
                          "tokens": stats.n_tokens, "text_mib": round(src.stat().st_size / 2**20, 1),
                          "seconds": round(stats.seconds, 2), "tokens_per_s": round(stats.tokens_per_s)}), flush=True)


READER = """
import json, random, resource, sys
import torch
from torch.utils.data import DataLoader
from dptrain.data.packed import build_packed
source, rows = sys.argv[1], int(sys.argv[2])
ds, _ = build_packed(source=source, seq_len=512)
r = random.Random(0)
idx = [r.randrange(len(ds)) for _ in range(rows)]
n = 0
for batch in DataLoader(torch.utils.data.Subset(ds, idx), batch_size=16, num_workers=2):
    n += int(batch["input_ids"].numel())
me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"rows": len(ds), "tokens_read": n, "peak_rss_mib": round(me / 1024, 1),
                  "worker_peak_rss_mib": round(kids / 1024, 1)}))
"""


def memory(tmp: Path, mib: int, rows: int) -> None:
    from dptrain.data.prepare import prepare

    base = make_docs(max(1, mib * 2**20 // 1500), seed=1)
    for factor in (1, 4, 16):
        src = tmp / f"mem-{factor}.jsonl"
        with open(src, "w") as f:
            for _ in range(factor):
                f.write("".join(json.dumps({"text": d}) + "\n" for d in base))
        out = tmp / f"mem-{factor}"
        prepare([str(src)], tokenizer="bytes", out=out, workers=2, shard_docs=5000)
        src.unlink()
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-c", READER, str(out), str(rows)], capture_output=True, text=True,
                             check=True)
        rec = json.loads(res.stdout.strip().splitlines()[-1])
        n_tokens = json.loads((out / "manifest.json").read_text())["n_tokens"]
        print(json.dumps({"what": "memory", "corpus": f"{factor}x", "tokens": n_tokens,
                          "token_file_mib": round(n_tokens * 2 / 2**20, 1), **rec,
                          "seconds": round(time.perf_counter() - t0, 2)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=20000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rss-mib", type=int, default=16, help="text MiB of the 1x corpus")
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument("--only", choices=["prepare", "memory"], help="run one of the two measurements")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        if a.only != "memory":
            throughput(Path(d), a.docs, a.workers)
        if a.only != "prepare":
            memory(Path(d), a.rss_mib, a.rows)
    print(json.dumps({"what": "host_peak_rss_mib", "value": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                                                      / 1024, 1)}))


if __name__ == "__main__":
    main()
