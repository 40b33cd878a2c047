"""nanogpt_base.py ported to dptrain's own-loop API (docs/guides/porting.md).

    dptrain launch --nproc-per-node 2 examples/ports/nanogpt_dptrain.py --max_iters 10   # 2 processes
    python examples/ports/nanogpt_dptrain.py --max_iters 10                                # a world of one

Every rank saves (rank 0 evaluates and decides; dptrain.broadcast tells the others), with best_val_loss and
model_args in `extra` and the RNG as it was when the step's batch was drawn: `--init_from resume` continues
bit for bit.
"""

import argparse
import json
import math
import os
import textwrap

import torch
import torch.nn as nn
from torch.nn import functional as F

import dptrain

parser = argparse.ArgumentParser()
parser.add_argument("--out_dir", default="out")
parser.add_argument("--eval_interval", type=int, default=4)
parser.add_argument("--eval_iters", type=int, default=2)
parser.add_argument("--always_save_checkpoint", action="store_true")
parser.add_argument("--init_from", default="scratch", choices=["scratch", "resume"])
parser.add_argument("--gradient_accumulation_steps", type=int, default=4)  # in total, over all processes
parser.add_argument("--batch_size", type=int, default=4)
parser.add_argument("--block_size", type=int, default=16)
parser.add_argument("--n_embd", type=int, default=32)
parser.add_argument("--learning_rate", type=float, default=1e-2)
parser.add_argument("--max_iters", type=int, default=10)
parser.add_argument("--warmup_iters", type=int, default=2)
parser.add_argument("--lr_decay_iters", type=int, default=10)
parser.add_argument("--min_lr", type=float, default=1e-3)
parser.add_argument("--grad_clip", type=float, default=1.0)
parser.add_argument("--losses", default=None, help="write the logged losses to this JSON file")
args = parser.parse_args()


class TinyGPT(nn.Module):
    """Token and position embeddings, one causal self-attention layer, an MLP and the head."""

    def __init__(self, vocab_size, block_size, n_embd):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.attn = nn.MultiheadAttention(n_embd, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(n_embd), nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets):
        t = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(t))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        x = x + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        logits = self.head(x + self.mlp(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


runtime = dptrain.init_distributed()
ddp_rank, ddp_world_size = runtime.rank, runtime.world_size
master_process = runtime.is_main
seed_offset = ddp_rank
assert args.gradient_accumulation_steps % ddp_world_size == 0
args.gradient_accumulation_steps //= ddp_world_size
if master_process:
    os.makedirs(args.out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)

data = torch.tensor(list(open(textwrap.__file__, "rb").read()), dtype=torch.long)
n = int(0.9 * len(data))
splits = {"train": data[:n], "val": data[n:]}


def get_batch(split):
    d = splits[split]
    ix = torch.randint(len(d) - args.block_size, (args.batch_size,))
    x = torch.stack([d[i : i + args.block_size] for i in ix])
    y = torch.stack([d[i + 1 : i + 1 + args.block_size] for i in ix])
    return x, y


best_val_loss = 1e9
model_args = dict(vocab_size=256, block_size=args.block_size, n_embd=args.n_embd)
model = TinyGPT(**model_args)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
model = dptrain.parallelize(model, strategy="ddp").module
ckpt = dptrain.Checkpointer(args.out_dir, model, optimizer, resume="auto" if args.init_from == "resume" else "none")
iter_num = ckpt.resume()  # model, optimizer, every rank's RNG
best_val_loss = ckpt.extra.get("best_val_loss", best_val_loss)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = get_batch(split)
            logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it):
    if it < args.warmup_iters:
        return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
    if it > args.lr_decay_iters:
        return args.min_lr
    decay_ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return args.min_lr + coeff * (args.learning_rate - args.min_lr)


log = {"loss": [], "val": []}
rng = dptrain.rng_state()  # the RNG as the batch of iter_num is drawn: what a checkpoint of iter_num saves
X, Y = get_batch("train")  # fetch the very first batch
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    if iter_num % args.eval_interval == 0:
        losses = estimate_loss() if master_process else None
        if master_process:
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            log["val"].append([iter_num, losses["val"]])
        losses = dptrain.broadcast(losses)  # rank 0's numbers, so its decision, on every rank
        if losses["val"] < best_val_loss or args.always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:  # on every rank: save is collective
                ckpt.save(iter_num, extra={"best_val_loss": best_val_loss, "model_args": model_args}, rng=rng)
    if iter_num >= args.max_iters:
        break

    for micro_step in range(args.gradient_accumulation_steps):
        with dptrain.sync_gradients(model, micro_step == args.gradient_accumulation_steps - 1):
            logits, loss = model(X, Y)
            loss = loss / args.gradient_accumulation_steps
            rng = dptrain.rng_state()
            X, Y = get_batch("train")  # immediately fetch the next batch
            loss.backward()
    if args.grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    if master_process:
        lossf = loss.item() * args.gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}")
        log["loss"].append([iter_num, lossf])
    iter_num += 1

if master_process and args.losses:
    with open(args.losses, "w") as f:
        json.dump({**log, "best_val_loss": best_val_loss}, f)
