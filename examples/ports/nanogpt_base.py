"""A torchrun DDP script in the shape of karpathy/nanoGPT train.py: batches drawn with torch.randint from a token
array (the next one fetched right after each step), gradient accumulation divided by the world size, the last
micro-step alone syncing gradients, a cosine learning rate set by hand, an evaluation on the master process, and
a checkpoint dict (model, optimizer, model_args, iter_num, best_val_loss) saved by the master process when the
validation loss improved; `--init_from resume` continues. A tiny causal model on the bytes of a standard-library
module: nothing to download.

    torchrun --nproc-per-node 2 examples/ports/nanogpt_base.py --max_iters 10

Its port is nanogpt_dptrain.py (docs/guides/porting.md shows the diff).
"""

import argparse
import json
import math
import os
import textwrap

import torch
import torch.nn as nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

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


ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="gloo")
    ddp_rank = int(os.environ["RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert args.gradient_accumulation_steps % ddp_world_size == 0
    args.gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
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


iter_num = 0
best_val_loss = 1e9
model_args = dict(vocab_size=256, block_size=args.block_size, n_embd=args.n_embd)
model = TinyGPT(**model_args)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
if args.init_from == "resume":
    checkpoint = torch.load(os.path.join(args.out_dir, "ckpt.pt"), map_location="cpu")
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    iter_num = checkpoint["iter_num"]
    best_val_loss = checkpoint["best_val_loss"]
    checkpoint = None
if ddp:
    model = DDP(model)
raw_model = model.module if ddp else model


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
X, Y = get_batch("train")  # fetch the very first batch
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    if iter_num % args.eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        log["val"].append([iter_num, losses["val"]])
        if losses["val"] < best_val_loss or args.always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                checkpoint = {
                    "model": raw_model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "model_args": model_args,
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                }
                torch.save(checkpoint, os.path.join(args.out_dir, "ckpt.pt"))
    if iter_num >= args.max_iters:
        break

    for micro_step in range(args.gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == args.gradient_accumulation_steps - 1
        logits, loss = model(X, Y)
        loss = loss / args.gradient_accumulation_steps
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
if ddp:
    destroy_process_group()
