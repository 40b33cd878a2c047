"""The node's snapshot folder (store.py): its layout, the parts, and cleaning up.

`<snapshot_dir>/<run id>/<host>/`: `step_NNNNNN/` (a snapshot's files: this node's ranks' and the replica of the
previous node's), `parts/step_NNNNNN.rank_RRRRR.json` (one per rank's share of a snapshot, written last: a part
names only files fully written), `.slots/` (the mapped files the snapshots link, flat.py) and `owner.json`
(the launcher process that owns the folder; a folder whose owner is gone belongs to a dead run).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dptrain.checkpoint import manifest as mf

PARTS = "parts"
OWNER = "owner.json"


def run_id(run_dir: Path) -> str:
    """The run's folder name under the memory root: the same on every node and after every restart."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def part_name(step: int, rank: int) -> str:
    """`step_000012.rank_00001.json`: the part of `rank` of the snapshot of `step`."""
    return f"{mf.step_dir_name(step)}.rank_{rank:05d}.json"


def write_file(path: Path, data: bytes | memoryview) -> None:
    """Write-temp + rename (no fsync: the folder is in memory)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def pack(part: dict[str, Any], files: dict[str, bytes]) -> bytes:
    """One message: a JSON header (the part and the file names with sizes), then the files' bytes."""
    header = json.dumps({"part": part, "files": [[name, len(data)] for name, data in files.items()]}).encode()
    return len(header).to_bytes(8, "little") + header + b"".join(files.values())


def unpack(blob: bytes | memoryview) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The inverse of `pack`."""
    view = memoryview(blob)
    n = int.from_bytes(view[:8], "little")
    header = json.loads(bytes(view[8 : 8 + n]))
    files, at = {}, 8 + n
    for name, size in header["files"]:
        files[name] = bytes(view[at : at + size])
        at += size
    return header["part"], files


def store_part(node_dir: Path, part: dict[str, Any], files: Mapping[str, bytes | memoryview]) -> None:
    """Write a part's files into the node's step folder, then the part itself (last)."""
    step_dir = node_dir / mf.step_dir_name(part["step"])
    step_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (step_dir / name).parent.mkdir(parents=True, exist_ok=True)
        write_file(step_dir / name, data)
    (node_dir / PARTS).mkdir(exist_ok=True)
    write_file(node_dir / PARTS / part_name(part["step"], part["rank"]), json.dumps(part).encode())


def read_part_files(node_dir: Path, part: dict[str, Any]) -> dict[str, bytes]:
    """The bytes of a part's files, from the node's step folder."""
    step_dir = node_dir / mf.step_dir_name(part["step"])
    return {name: (step_dir / name).read_bytes() for name in part["files"]}


def holdings(node_dir: Path) -> dict[int, dict[int, dict[str, Any]]]:
    """The parts this node holds: step -> rank -> part (its own ranks' and the replicas)."""
    out: dict[int, dict[int, dict[str, Any]]] = {}
    parts = node_dir / PARTS
    if not parts.is_dir():
        return out
    for p in sorted(parts.glob("step_*.rank_*.json")):
        try:
            part = json.loads(p.read_text())
            out.setdefault(int(part["step"]), {})[int(part["rank"])] = part
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable: as if absent (parts are written by rename, so only a foreign file)
    return out


def drop_steps(node_dir: Path, *, keep: set[int]) -> None:
    """Delete every snapshot of the node except the steps in `keep` (parts first, then the step folders: a slot
    they link lives on in its pair, flat.py)."""
    parts = node_dir / PARTS
    for name in os.listdir(parts) if parts.is_dir() else []:
        step = mf.step_of(Path(name.split(".")[0]))
        if step is not None and step not in keep:
            (parts / name).unlink(missing_ok=True)
    doomed = []
    if node_dir.is_dir():
        with os.scandir(node_dir) as entries:
            doomed = [e.path for e in entries if mf.step_of(Path(e.name)) not in keep | {None} and e.is_dir()]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_runs(root: Path, *, host: str, own: str) -> list[Path]:
    """Remove `root/<other run>/<host>` folders whose owner process (owner.json) is gone; the removed ones."""
    removed = []
    for run in root.iterdir() if root.is_dir() else []:
        node = run / host
        if run.name == own or not node.is_dir():
            continue
        try:
            pid = int(json.loads((node / OWNER).read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            pid = -1
        if pid <= 0 or not pid_alive(pid):
            shutil.rmtree(node, ignore_errors=True)
            removed.append(node)
            with_other_nodes = any(run.iterdir()) if run.is_dir() else True
            if not with_other_nodes:
                run.rmdir()
    return removed
