"""Pre-flight checks: before training, every rank agrees on world size, config and model.

One `all_gather_object` carries each rank's facts; every rank compares all of them the same
way, so every rank raises the same `PreflightError` naming the first difference (the first
differing parameter for a model mismatch). It runs before the strategy wraps the model, so it
speaks before DDP's or FSDP's own collectives can fail or hang on a mismatch.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from torch import nn

from dptrain.distributed.collectives import all_gather_object

# Config keys that legitimately differ between nodes (each node runs its own `dptrain run` with
# its launch.node_rank, and may pick its own timestamped run directory): not compared.
NODE_LOCAL_PREFIXES = ("launch.", "log.")


class PreflightError(RuntimeError):
    """Ranks disagree on world size, config or model; the message is the same on every rank."""


def model_fingerprint(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every parameter and buffer, in registration order."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors]


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config dict as dotted keys with printable values."""
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = repr(v)
    return out


def local_facts(*, world_size: int, config: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """What this rank believes; compared across ranks by `compare_facts`."""
    flat = {k: v for k, v in flatten(config).items() if not k.startswith(NODE_LOCAL_PREFIXES)}
    digest = hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:12]
    return {"world_size": world_size, "config_hash": digest, "config": flat, "model": model_fingerprint(model)}


def compare_facts(facts: list[dict[str, Any]], *, joined: int) -> str | None:
    """The first disagreement among the ranks' facts (rank 0 is the reference), or None."""
    for r, f in enumerate(facts):
        if f["world_size"] != joined:
            return (f"world size mismatch: rank {r} was started with WORLD_SIZE={f['world_size']} but {joined} ranks "
                    "joined the process group; start every rank with the same --nproc-per-node/--nnodes")
    ref = facts[0]
    for r, f in enumerate(facts[1:], start=1):
        if f["config_hash"] != ref["config_hash"]:
            keys = sorted(set(ref["config"]) | set(f["config"]))
            key = next(k for k in keys if ref["config"].get(k) != f["config"].get(k))
            return (f"config mismatch: rank {r}'s config (sha256 {f['config_hash']}) differs from rank 0's "
                    f"({ref['config_hash']}); first differing key: {key} = {ref['config'].get(key, '<missing>')} on "
                    f"rank 0, {f['config'].get(key, '<missing>')} on rank {r}; start every rank from the same config")
    for r, f in enumerate(facts[1:], start=1):
        message = _compare_models(ref["model"], f["model"], rank=r)
        if message:
            return message
    return None


def _compare_models(ref: list[tuple], other: list[tuple], *, rank: int) -> str | None:
    def show(entry: tuple | None) -> str:
        return "absent" if entry is None else f"shape {tuple(entry[1])} dtype {entry[2]}"

    for i in range(max(len(ref), len(other))):
        a = ref[i] if i < len(ref) else None
        b = other[i] if i < len(other) else None
        if a != b:
            name = (a or b)[0]  # type: ignore[index]
            if a is not None and b is not None and a[0] != b[0]:
                detail = f"rank 0 has {a[0]!r} ({show(a)}) where rank {rank} has {b[0]!r} ({show(b)})"
            else:
                detail = f"{show(a)} on rank 0, {show(b)} on rank {rank}"
            return (f"model mismatch: rank {rank}'s model differs from rank 0's at parameter {name!r}: {detail} "
                    f"({len(ref)} vs {len(other)} tensors); every rank must build the same model")
    return None


def run_preflight(*, world_size: int, config: dict[str, Any], model: nn.Module) -> None:
    """Gather every rank's facts and raise `PreflightError` on every rank when they disagree."""
    facts = local_facts(world_size=world_size, config=config, model=model)
    gathered = all_gather_object(facts)
    joined = len(gathered)
    message = compare_facts(gathered, joined=joined)
    if message:
        raise PreflightError(f"pre-flight check failed: {message}")

