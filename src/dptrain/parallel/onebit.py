"""`onebit`: sign compression with error feedback as a DDP communication hook (EF-SignSGD; the
compression stage of 1-bit Adam, applied to the gradient).

Per bucket and step, on every rank: add the rank's error buffer to the gradient (`corrected`), send
the sign of each element as one bit (8 packed per uint8 byte) plus one scale per parameter tensor
(the mean of |corrected| over that tensor: for a sign vector s, the a that minimises
||corrected - a s||^2), and keep `error = corrected - decompressed` for the next step. The packed
bytes and scales travel in one uint8 message through `all_gather` (torch.distributed's own
collective); every rank decodes every rank's message and averages, in rank order, so all replicas
end with the same gradient.

Why a scale per tensor rather than one per bucket: gradient magnitudes differ by orders of magnitude
between tensors (embeddings, norm weights, projections), and a bucket-wide scale would give small
tensors huge steps that only the error feedback undoes later; it costs 4 bytes per tensor. It also
makes the result independent of where a tensor sits in the bucket, so DDP's bucket rebuild cannot
change the numbers (see bucket_layout.py).

Bytes a rank sends per step: ceil(n / 8) + 4 * tensors for n gradient elements (about 1/32 of an
fp32 all-reduce's payload); all_gather makes each rank receive that from each of the others.
"""

# No `from __future__ import annotations`: DDP checks the hook's `bucket` and return annotations
# against the real classes.
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dptrain.parallel.bucket_layout import BucketLayout

_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def pack_signs(positive: torch.Tensor) -> torch.Tensor:
    """A bool vector (True: >= 0) -> uint8 bytes, 8 signs each, the first element in the high bit;
    zero-padded to a multiple of 8 (numpy's packbits on the CPU: the same bytes, several times faster)."""
    if positive.device.type == "cpu":
        return torch.from_numpy(np.packbits(positive.reshape(-1).numpy()))
    bits = positive.reshape(-1).to(torch.uint8)
    bits = torch.nn.functional.pad(bits, (0, (-bits.numel()) % 8)).view(-1, 8)
    return (bits << _SHIFTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack_signs`: the first `n` signs as a bool vector."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.reshape(-1).numpy(), count=n).view(np.bool_))
    bits = (packed.reshape(-1, 1) >> _SHIFTS.to(packed.device)) & 1
    return bits.reshape(-1)[:n].bool()


def tensor_scales(values: torch.Tensor, numels: list[int]) -> torch.Tensor:
    """One scale per tensor of a flat bucket: sum(|x|) / numel over its elements (0 for an empty one)."""
    return torch.stack([seg.abs().sum() / max(n, 1) for seg, n in zip(values.split(numels), numels, strict=True)])


def decompress(positive: torch.Tensor, scales: torch.Tensor, numels: list[int]) -> torch.Tensor:
    """+scale where the sign bit is set, -scale elsewhere, each tensor with its own scale."""
    per_element = torch.repeat_interleave(scales, torch.tensor(numels, device=scales.device))
    return torch.where(positive, per_element, -per_element)


def encode(corrected: torch.Tensor, numels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(message, decompressed): the uint8 message (the scales' bytes, then the packed signs) and what
    every rank will decode from it."""
    positive = corrected >= 0
    scales = tensor_scales(corrected, numels)
    message = torch.cat([scales.view(torch.uint8), pack_signs(positive)])  # scales first: aligned to view back
    return message, decompress(positive, scales, numels)


def decode(message: torch.Tensor, numels: list[int], dtype: torch.dtype) -> torch.Tensor:
    """One rank's message -> its decompressed bucket."""
    n_scale_bytes = len(numels) * torch.empty(0, dtype=dtype).element_size()
    scales = message[:n_scale_bytes].view(dtype)
    return decompress(unpack_signs(message[n_scale_bytes:], sum(numels)), scales, numels)


def payload_bytes(numel: int, tensors: int, element_size: int) -> int:
    """Bytes of one rank's message for a bucket of `numel` elements in `tensors` tensors."""
    return (numel + 7) // 8 + tensors * element_size


class OneBitState:
    """The onebit hook's state on one rank: its error buffers (per bucket, layout-free on save), the
    step counter for `start_step` and the process group."""

    def __init__(self, process_group: Any, *, start_step: int = 0) -> None:
        self.process_group = process_group
        self.start_step = start_step
        self.step = 0
        """Optimizer steps whose gradients this hook has reduced (counted at the last bucket)."""
        self.error: dict[int, torch.Tensor] = {}
        self.layout = BucketLayout()
        self.last_payload: dict[int, int] = {}
        """bucket index -> bytes this rank handed to collectives in the last call for it."""
        self.last_collective: dict[int, str] = {}
        """bucket index -> the collective of that call: all_reduce (warmup) or all_gather."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "onebit", "step": self.step,
                "error": self.layout.export("error", self.error, self.layout.element_pieces)}

    def park(self) -> None:
        """DDP re-laid its buckets out: keep the error buffers per parameter until each bucket is seen."""
        self.layout.park("error", self.error, self.layout.element_pieces)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.error = {}
        self.layout.load({"error": sd["error"]})


def onebit_hook(state: OneBitState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: see the module docstring. Returns the future of the averaged,
    decompressed bucket (written into the bucket's buffer)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer, index = bucket.buffer(), bucket.index()
    state.layout.observe(bucket, park=state.park)
    warmup = state.step < state.start_step
    if bucket.is_last():  # bucket 0 is reduced last: the step's end
        state.step += 1
    if warmup:  # a plain all-reduce of the average, the error untouched
        state.last_payload[index] = buffer.numel() * buffer.element_size()
        state.last_collective[index] = "all_reduce"
        fut = dist.all_reduce(buffer.div_(world), group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    numels = [g.numel() for g in bucket.gradients()]
    if index not in state.error:
        loaded = state.layout.join("error", state.layout.element_pieces(index), buffer)
        state.error[index] = loaded if loaded is not None else torch.zeros_like(buffer)
    corrected = buffer + state.error[index]
    message, local = encode(corrected, numels)
    torch.sub(corrected, local, out=state.error[index])  # what this rank's message leaves out
    state.last_payload[index] = message.numel()
    state.last_collective[index] = "all_gather"
    gathered = [torch.empty_like(message) for _ in range(world)]
    fut = dist.all_gather(gathered, message, group=group, async_op=True).get_future()

    def average(_: torch.futures.Future[Any]) -> torch.Tensor:
        total = torch.zeros_like(buffer)
        for msg in gathered:  # rank order: the same sum on every rank
            total += decode(msg, numels, buffer.dtype)
        return buffer.copy_(total.div_(world))

    return fut.then(average)
