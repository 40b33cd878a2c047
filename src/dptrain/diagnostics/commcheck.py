"""`dptrain doctor --comm`: all-reduce bandwidth/latency sweep and point-to-point link check.

Run by torchrun on every rank (`python -m dptrain.diagnostics.commcheck`). Bandwidths follow
nccl-tests' definitions: for an all-reduce of S bytes taking t seconds on n ranks, the
algorithm bandwidth is S / t and the bus bandwidth is S / t * 2(n-1)/n, the traffic each link
carries in a ring all-reduce, comparable with the hardware's link speed. t is the slowest
rank's time per iteration (an all-reduce ends when the last rank is done).

Links: every pair of ranks (ring neighbours only above 8 ranks) exchanges a 4 MiB message
back and forth while the others wait; a pair below half the median bandwidth is named, and a
rank in every slow pair is named as the slow rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dptrain.distributed.env import DistEnv
from dptrain.distributed.process_group import bind_device, process_group

SIZES = [4 * 2**10 * 4**i for i in range(8)]  # 4 KiB .. 64 MiB
P2P_BYTES = 4 * 2**20
SLOW_FRACTION = 0.5


def _timed(fn, iters: int, device: torch.device) -> float:
    """Seconds per call of `fn`, the slowest rank's (all ranks start together)."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def sweep(device: torch.device, *, budget_s: float = 0.5) -> list[dict[str, float]]:
    """One row per message size: seconds per all-reduce, algbw and busbw in GB/s."""
    n = dist.get_world_size()
    _timed(lambda: dist.all_reduce(torch.ones(1024, device=device)), 20, device)  # connections, first-call setup
    rows = []
    for size in SIZES:
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        first = _timed(lambda x=x: dist.all_reduce(x), 1, device)  # warm-up, and a guess of the cost
        iters = max(3, min(100, int(budget_s / max(first, 1e-6))))
        t = _timed(lambda x=x: dist.all_reduce(x), iters, device)
        algbw = size / t / 1e9
        rows.append({"bytes": size, "seconds": t, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (n - 1) / n})
    return rows


def link_pairs(n: int) -> list[tuple[int, int]]:
    if n <= 8:
        return [(i, j) for i in range(n) for j in range(i + 1, n)]
    return [(i, (i + 1) % n) for i in range(n)]


def ping_pong(pairs: list[tuple[int, int]], device: torch.device, iters: int = 5) -> dict[tuple[int, int], float]:
    """GB/s of each pair exchanging P2P_BYTES back and forth, measured one pair at a time."""
    rank = dist.get_rank()
    buf = torch.ones(P2P_BYTES // 4, dtype=torch.float32, device=device)
    out = {}
    for a, b in pairs:
        dist.barrier()
        t0 = time.perf_counter()
        if rank in (a, b):
            peer = b if rank == a else a
            for _ in range(iters):
                if rank == a:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
        elapsed = torch.tensor(
            [time.perf_counter() - t0 if rank in (a, b) else 0.0], dtype=torch.float64, device=device
        )
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        out[(a, b)] = 2 * iters * P2P_BYTES / elapsed.item() / 1e9
    return out


def slow_links(bw: dict[tuple[int, int], float]) -> tuple[list[tuple[int, int]], list[int]]:
    """Pairs below SLOW_FRACTION of the median bandwidth, and ranks that are in every slow pair."""
    if len(bw) < 2:
        return [], []
    median = statistics.median(bw.values())
    slow = [p for p, v in bw.items() if v < SLOW_FRACTION * median]
    ranks = sorted({r for p in slow for r in p if all(r in q for q in slow)}) if slow else []
    return slow, ranks


def format_results(
    rows: list[dict[str, float]], bw: dict[tuple[int, int], float], hosts: list[str], backend: str
) -> str:
    n = len(hosts)
    lines = [
        f"all-reduce, {n} ranks, {backend} (busbw = algbw * 2(n-1)/n, as nccl-tests defines it):",
        f"{'size':>10} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}",
    ]
    for r in rows:
        lines.append(
            f"{_size(int(r['bytes'])):>10} {r['seconds'] * 1e6:>10.1f} "
            f"{r['algbw_gbps']:>11.3f} {r['busbw_gbps']:>11.3f}"
        )
    lines.append(
        f"latency (4 KiB all-reduce): {rows[0]['seconds'] * 1e6:.0f} us; "
        f"peak bus bandwidth: {max(r['busbw_gbps'] for r in rows):.3f} GB/s"
    )
    lines.append(f"point-to-point links ({_size(P2P_BYTES)} ping-pong):")
    for (a, b), v in bw.items():
        lines.append(f"  rank {a} ({hosts[a]}) <-> rank {b} ({hosts[b]}): {v:.3f} GB/s")
    slow, ranks = slow_links(bw)
    if slow:
        median = statistics.median(bw.values())
        for a, b in slow:
            lines.append(
                f"  ! slow link: rank {a} ({hosts[a]}) <-> rank {b} ({hosts[b]}): {bw[(a, b)]:.3f} GB/s, "
                f"below {SLOW_FRACTION:.0%} of the median {median:.3f} GB/s"
            )
        for rank in ranks:
            lines.append(
                f"  ! slow rank: rank {rank} ({hosts[rank]}) is in every slow link: check its NIC, cable or placement"
            )
    else:
        lines.append("  no slow link" + (" (one pair: nothing to compare)" if len(bw) < 2 else ""))
    return "\n".join(lines)


def _size(b: int) -> str:
    return f"{b // 2**20} MiB" if b >= 2**20 else f"{b // 2**10} KiB"


def write_json(
    path: str, rows: list[dict[str, float]], bw: dict[tuple[int, int], float], hosts: list[str], backend: str
) -> None:
    """The sweep as JSON (what `dptrain plan --comm FILE` fits alpha and beta to), written atomically."""
    doc = {
        "kind": "dptrain.commcheck",
        "ranks": len(hosts),
        "backend": backend,
        "hosts": hosts,
        "all_reduce": rows,
        "p2p_gbps": [{"ranks": list(p), "gbps": v} for p, v in bw.items()],
        "p2p_bytes": P2P_BYTES,
    }
    tmp = Path(f"{path}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dptrain.diagnostics.commcheck")
    parser.add_argument("--json", help="also write the results to this file (rank 0)")
    args = parser.parse_args(argv)
    env = DistEnv.from_env()
    device = bind_device(env, "cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    with process_group(env, backend=backend, device=device, timeout_s=300):
        hosts: list = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
        rows = sweep(device)
        bw = ping_pong(link_pairs(dist.get_world_size()), device)
        if env.is_main:
            print(format_results(rows, bw, hosts, backend), flush=True)
            if args.json:
                write_json(args.json, rows, bw, hosts, backend)
                print(f"wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
