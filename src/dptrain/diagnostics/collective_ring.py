"""What one rank says about its collectives: the flight recorder's ring plus where its main thread is.

The ring (distributed/flight_recorder.py) gives, per collective, the group, its sequence number, the op,
the shapes and dtypes, whether it finished, and the Python frames that issued it (torch records them for
every entry; its pickle dump has them, its JSON dump does not): `read_calls(sites=True)` gives each call's
line. gloo's send/recv are not recorded at all (torch 2.13), and a finished collective says nothing about
where the rank is now, so `snapshot` adds the main thread's position, read from its stack
(`sys._current_frames`, no cost until asked), and the send/recv it waits in (`p2p_wait`): the innermost
line outside torch, and, when that line is dptrain's own, the user's line that called it
("checkpointer.py:279 in _all_here, called from train.py:40"); plus the c10d function it waits in
(`barrier`, `monitored_barrier`, ...) or "backward" when it is inside autograd (DDP reduces gradients
there). Snapshots are plain JSON; diagnostics/desync.py compares them.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dptrain.diagnostics.loader_stacks import SKIPPED_DIRS, waits_for_loader, worker_sites
from dptrain.distributed.collective_calls import Call
from dptrain.distributed.flight_recorder import recorder_size

# Where a rank blocked in a collective waits: c10d calls, FSDP/DDP hooks, the autograd engine
# (DDP reduces gradients inside backward). The innermost Python frame of such a rank is in one.
WAITING_IN = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/")
_TORCH_DIR = os.path.dirname(torch.__file__).replace("\\", "/") + "/"
DPTRAIN_DIR = str(Path(__file__).resolve().parents[1]).replace("\\", "/") + "/"
_C10D_FILE = "torch/distributed/distributed_c10d.py"


def read_calls(now_ns: int | None = None, *, sites: bool = False) -> list[Call]:
    """This process's ring, oldest first (empty when the recorder is off or this torch has no dump); `sites`: with
    the line that called each collective (torch records every entry's Python frames; +~0.2 ms for 128 entries).
    Read from torch's pickle dump: its JSON dump takes ~10x as long (12 vs 0.9 ms for 128 entries, torch 2.13)."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None or recorder_size() == 0:
        return []
    entries = pickle.loads(dump(True, sites, False)).get("entries", [])  # this process's own dump
    now = time.time_ns() if now_ns is None else now_ns
    return [entry_call(e, now, site=frames_site(e.get("frames") or []) if sites else "") for e in entries]


def entry_call(e: dict[str, Any], now_ns: int, *, site: str = "") -> Call:
    """One flight-recorder entry as a `Call`; `now_ns`: for its age."""
    pg = e.get("process_group") or ["?", ""]
    age = max(0, now_ns - int(e.get("time_created_ns") or now_ns)) / 1e9
    return Call(pg=str(pg[0]), seq=int(e.get("collective_seq_id", 0)),
                op=str(e.get("profiling_name", "?")).split(":", 1)[-1],
                sizes=[list(s) for s in e.get("input_sizes", [])], dtypes=[str(d) for d in e.get("input_dtypes", [])],
                done=bool(e.get("retired", False)), age_s=round(age, 3), p2p=bool(e.get("is_p2p", False)), site=site)


def frames_site(frames: list[dict[str, Any]]) -> str:
    """"losses.py:81 in collective_shape_differs" from a flight-recorder entry's frames (innermost first): the first
    one outside torch and the standard library, with the user's line when that one is dptrain's own; "" if none
    (a collective DDP's reducer issued from autograd's thread)."""
    own = [f for f in frames if not str(f.get("filename", "")).replace("\\", "/").startswith(SKIPPED_DIRS)]
    if not own:
        return ""

    def short(f: dict[str, Any]) -> str:
        return f"{os.path.basename(str(f.get('filename')))}:{f.get('line')} in {f.get('name')}"

    site = short(own[0])
    if str(own[0].get("filename", "")).startswith(DPTRAIN_DIR):
        user = next((f for f in own if not str(f.get("filename", "")).startswith((DPTRAIN_DIR, "<"))), None)
        if user is not None:
            site += f", called from {short(user)}"
    return site


def _path(frame: types.FrameType) -> str:
    return frame.f_code.co_filename.replace("\\", "/")


def _short(frame: types.FrameType) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def main_thread_frame() -> types.FrameType | None:
    return sys._current_frames().get(threading.main_thread().ident or -1)


def main_thread_position() -> tuple[str, bool]:
    """("file:line in function" of the main thread's innermost Python frame, whether it is in torch's
    distributed or autograd code, i.e. most likely waiting for other ranks)."""
    frame = main_thread_frame()
    if frame is None:
        return "?", False
    code = frame.f_code
    path = _path(frame)
    # A DTensor (tensor-parallel) collective waits in torch's op dispatcher (torch/_ops.py), called
    # from torch/distributed's functional collectives: judge by the first frame outside the dispatcher.
    caller: types.FrameType | None = frame
    caller_path = path
    while caller is not None and caller_path.endswith("torch/_ops.py"):
        caller = caller.f_back
        caller_path = _path(caller) if caller is not None else ""
    return f"{path}:{frame.f_lineno} in {code.co_name}", any(part in caller_path for part in WAITING_IN)


def call_site(frame: types.FrameType | None) -> tuple[str, str | None]:
    """(where the stack's own code is: "checkpointer.py:279 in _all_here, called from train.py:40", what it
    waits in: the c10d function (`barrier`, `all_reduce`, ...), "backward" inside autograd, else None)."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    # the outermost c10d function: the one the caller called (all_gather_object, not the all_gather inside it)
    blocked = next((f.f_code.co_name for f in reversed(frames) if _path(f).endswith(_C10D_FILE)), None)
    if blocked is None and any("torch/autograd/" in _path(f) for f in frames):
        blocked = "backward"
    own = [f for f in frames if not _path(f).startswith(SKIPPED_DIRS)]  # not torch's, not the standard library's
    if not own:
        return "?", blocked
    site = _short(own[0])
    if _path(own[0]).startswith(DPTRAIN_DIR):
        # the user's code: not dptrain's, and not the interpreter's own (`<frozen runpy>` under `python -m`)
        user = next((f for f in own if not _path(f).startswith(DPTRAIN_DIR) and not _path(f).startswith("<")), None)
        if user is not None:
            site += f", called from {os.path.basename(user.f_code.co_filename)}:{user.f_lineno}"
    return site, blocked


P2P_OPS = {"recv": "src", "send": "dst"}
"""c10d's blocking point-to-point calls and the argument naming the peer (a global rank; `group_src`/`group_dst` a
rank of `group`). gloo's send/recv are not in the flight recorder (torch 2.13), so a rank blocked in one is read from
its stack: which call, which peer, what tensor."""


def p2p_wait(frame: types.FrameType | None) -> dict[str, Any] | None:
    """{"op": "recv", "peer": 0, "sizes": [[4]], "dtype": "Float"} when the stack waits in c10d's send or recv (the
    outermost such frame), else None. The peer is a global rank when the call named one (`src`/`dst`), else the group
    rank it named; None when it receives from any rank."""
    found = None
    while frame is not None:
        if _path(frame).endswith(_C10D_FILE) and frame.f_code.co_name in P2P_OPS:
            found = frame
        frame = frame.f_back
    if found is None:
        return None
    names = found.f_code.co_varnames[:found.f_code.co_argcount + found.f_code.co_kwonlyargcount]
    args = {k: v for k, v in found.f_locals.items() if k in names}  # the arguments only: no other local is read
    arg = P2P_OPS[found.f_code.co_name]
    peer = args.get(arg) if args.get(arg) is not None else args.get(f"group_{arg}")
    tensor = args.get("tensor")
    sizes = [list(tensor.shape)] if isinstance(tensor, torch.Tensor) else []
    dtype = str(tensor.dtype).removeprefix("torch.").capitalize() if isinstance(tensor, torch.Tensor) else ""
    return {"op": found.f_code.co_name, "peer": int(peer) if isinstance(peer, int) else None, "sizes": sizes,
            "dtype": dtype.replace("Float32", "Float")}


def group_members() -> dict[str, list[int]]:
    """{process group name: its global ranks} of the groups this rank belongs to."""
    out: dict[str, list[int]] = {}
    try:
        for pg, ranks in list(dist.distributed_c10d._world.pg_group_ranks.items()):
            out[str(pg.group_name)] = sorted(int(r) for r in ranks)
    except (AttributeError, RuntimeError):  # a group being made or destroyed right now: no members known
        pass
    return out


def snapshot(*, rank: int, heartbeat: dict[str, Any] | None = None) -> dict[str, Any]:
    """This rank's ring and main-thread position, as plain JSON (compared by diagnostics/desync.py)."""
    frame = main_thread_frame()
    site, blocked = call_site(frame)
    if blocked is None and waits_for_loader(frame):  # the batch it waits for is a DataLoader worker's to make
        site += "; waiting for its DataLoader: " + ("; ".join(worker_sites()) or "no worker answered")
    where, in_collective = main_thread_position()
    beat = heartbeat or {}
    return {"rank": rank, "host": beat.get("host", ""), "pid": beat.get("pid", os.getpid()),
            "ring": [list(c) for c in read_calls(sites=True)], "recorder": recorder_size() > 0,
            "groups": group_members(), "where": where, "site": site, "blocked_in": blocked,
            "in_collective": in_collective, "p2p": p2p_wait(frame),
            "step": beat.get("step"), "phase": beat.get("phase"), "label": beat.get("collective") or ""}


def format_stacks(*, skip_ident: int | None = None) -> str:
    """The Python stack of every thread in this process, the main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main)
    parts = []
    for ident, frame in frames:
        if ident == skip_ident:
            continue
        parts.append(f"Thread {names.get(ident, '?')} ({ident}), most recent call last:\n")
        parts.append("".join(traceback.format_stack(frame)))
    return "".join(parts)
