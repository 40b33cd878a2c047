"""1-bit Adam's communication (Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale
Training with Adam's Convergence Speed"): the compressed all-reduce of the momentum, and the DDP
hook that all-reduces gradients during the warm-up and nothing after it.

The optimizer (`train/onebit_adam.py`) runs plain Adam for `freeze_step` steps on all-reduced
gradients (this module's hook averages every bucket, like DDP's own reduction). Then the variance
freezes and DDP stops reducing: the hook hands each rank its local gradient back untouched, the
optimizer folds it into its momentum and calls `MomentumExchange.allreduce` on the momenta, the
only communication of a compressed step. That exchange, on every rank, for T momentum tensors over
W ranks:

1. worker: add this rank's worker error to its momentum (`corrected`); per tensor one scale, the
   RMS of the tensor (||x|| / sqrt(n), as in the paper and DeepSpeed), and one sign bit per element
   (>= 0 is +); `worker_error = corrected - scale * sign`.
2. each tensor, padded with zeros to W chunks of a multiple of 8 elements, is cut into W chunks;
   rank j is the *server* of chunk j of every tensor. One `all_to_all_single` sends chunk j's packed
   signs (and the T worker scales) to rank j.
3. server: decode the W ranks' chunks, sum them in rank order and divide by W, add the server
   error; per tensor one scale (the RMS over the chunk's real elements) and a sign per element;
   `server_error = compensated - scale * sign`.
4. one `all_gather` gives every rank every server's packed signs and scales; each rank decodes them
   into the same averaged momentum.

Padding elements never carry anything: their signs are sent but decode to 0, and both errors stay 0
there. Only all_to_all_single and all_gather are used; both exist on gloo (checked in
tests/test_onebit_adam.py) and NCCL. Bytes a rank sends per compressed step: 2 (W - 1) (4 T + C / 8),
C = the elements one server holds (about n / W): about 1/32 of the bytes of an fp32 ring all-reduce
(2 (W - 1) / W x 4 n) at any W, plus 8 (W - 1) T bytes of scales.

Errors are per rank (worker error: the whole momentum's size; server error: the rank's chunks): a
checkpoint saves them per rank (`state_dict`), the worker error per tensor without padding, the
server error with the world size it was cut for.
"""

# No `from __future__ import annotations`: DDP checks the hook's `bucket` and return annotations
# against the real classes.
import math
from typing import Any

import torch
import torch.distributed as dist

from dptrain.parallel.onebit import pack_signs, unpack_signs

SCALE_DTYPE = torch.float32
"""Scales travel as float32 (4 bytes each); the momenta are computed in float32 too."""


# ------------------------------------------------------------------------------- the layout
class ChunkLayout:
    """Where each of T tensors (element counts `numels`) sits in the exchange over `world` ranks:
    padded to `world` chunks of `widths[i]` elements (a multiple of 8), server j holding chunk j.

    Two flat layouts: the worker's, tensor after tensor, each padded (`offsets`, P = W x C elements),
    and a server's row, chunk j of every tensor in turn (`row_offsets`, C elements)."""

    def __init__(self, numels: list[int], world: int) -> None:
        self.numels, self.world = list(numels), world
        self.widths = [math.ceil(n / (8 * world)) * 8 for n in numels]
        self.width = sum(self.widths)
        """C: the elements one server holds (a multiple of 8)."""
        self.offsets = [world * sum(self.widths[:i]) for i in range(len(numels))]
        self.row_offsets = [sum(self.widths[:i]) for i in range(len(numels))]

    def padded(self, i: int) -> int:
        return self.widths[i] * self.world

    def real(self, i: int, j: int) -> int:
        """Elements of tensor i's chunk j that are not padding."""
        return max(0, min(self.widths[i], self.numels[i] - j * self.widths[i]))

    def message_bytes(self) -> int:
        """One rank's message to one server (phase 1) or from its server chunk (phase 2)."""
        return 4 * len(self.numels) + self.width // 8

    def sent_bytes(self) -> int:
        """Bytes this rank sends in one exchange: W - 1 messages in each phase."""
        return 2 * (self.world - 1) * self.message_bytes()

    def worker_mask(self) -> torch.Tensor:
        """1.0 on the worker layout's real elements, 0.0 on its padding."""
        mask = torch.zeros(self.world * self.width, dtype=SCALE_DTYPE)
        for o, n in zip(self.offsets, self.numels, strict=True):
            mask[o:o + n] = 1
        return mask

    def row_masks(self) -> torch.Tensor:
        """(W, C): row j is 1.0 on server j's real elements."""
        mask = torch.zeros(self.world, self.width, dtype=SCALE_DTYPE)
        for j in range(self.world):
            for i, o in enumerate(self.row_offsets):
                mask[j, o:o + self.real(i, j)] = 1
        return mask

    def send_order(self) -> torch.Tensor:
        """Byte indices into the worker layout's packed signs that make the W server rows in turn."""
        idx = [torch.arange((o + j * w) // 8, (o + (j + 1) * w) // 8)
               for j in range(self.world) for o, w in zip(self.offsets, self.widths, strict=True)]
        return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)


def rms(x: torch.Tensor, count: int) -> torch.Tensor:
    """||x|| / sqrt(count) (x's other elements are zero padding); 0 for count 0."""
    return torch.linalg.vector_norm(x) / math.sqrt(max(count, 1))


def values(positive: torch.Tensor, scale: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """+scale where `positive`, -scale elsewhere (`scale` per element or one), times `mask` (1.0
    on real elements, 0.0 on padding): what a message decodes to."""
    return positive.to(SCALE_DTYPE).mul_(2).sub_(1).mul_(scale).mul_(mask)


def compress(corrected: torch.Tensor, real: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, signs (>= 0), error = corrected - decompressed) of one (padded) vector with `real`
    elements before its padding."""
    scale = rms(corrected, real)
    positive = corrected >= 0
    mask = torch.zeros_like(corrected)
    mask[:real] = 1
    return scale, positive, corrected - values(positive, scale, mask)


def encode(scales: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """A uint8 message: the float32 scales' bytes, then the signs packed 8 per byte."""
    return torch.cat([scales.to(SCALE_DTYPE).view(torch.uint8), pack_signs(positive)])


def decode(message: torch.Tensor, tensors: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`encode`'s inverse: (scales, signs as bool) of one message."""
    n = 4 * tensors
    return message[:n].clone().view(SCALE_DTYPE), unpack_signs(message[n:], width)  # clone: 4-byte aligned


# ------------------------------------------------------------------------------- the exchange
class MomentumExchange:
    """This rank's side of the compressed all-reduce: its worker and server errors, and the DDP
    hook's state (`steps_done`: optimizer steps taken, set by the optimizer; `freeze_step`)."""

    def __init__(self, process_group: Any, *, freeze_step: int) -> None:
        self.process_group = process_group
        self.freeze_step = freeze_step
        self.steps_done = 0
        self.layout: ChunkLayout | None = None
        self.worker_error = torch.zeros(0)
        """The worker layout (zero in the padding)."""
        self.server_error = torch.zeros(0)
        """This rank's server row (zero in its padding)."""
        self._buffers: dict[str, torch.Tensor] = {}
        self._loaded: dict[str, Any] | None = None
        self.last_payload: dict[int, int] = {}
        """DDP bucket index -> bytes handed to the warm-up all-reduce in the last call."""
        self.unmetered = 0
        """Bytes sent by exchanges since the meter last read them (`take_sent`)."""

    @property
    def group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    @property
    def compressing(self) -> bool:
        """After the warm-up: gradients stay local, the momentum is exchanged."""
        return self.steps_done >= self.freeze_step

    def take_sent(self) -> float:
        sent, self.unmetered = self.unmetered, 0
        return float(sent)

    # ---------------------------------------------------------------- the collective
    def allreduce(self, momenta: list[torch.Tensor]) -> None:
        """Replace every rank's `momenta` (in place) by their compressed average: the same values on
        every rank. Collective over the group; nothing happens at world size 1."""
        world = self.world
        if world == 1:
            return
        rank = dist.get_rank(self.group)
        lay = self._layout([m.numel() for m in momenta], world, momenta[0].device)
        b, t, width = self._buffers, len(momenta), lay.width
        # phase 1, worker: compress the corrected momentum, one message per server
        flat, werr = b["flat"], self.worker_error
        for o, m in zip(lay.offsets, momenta, strict=True):
            flat[o:o + m.numel()].copy_(m.detach().reshape(-1))  # the padding stays 0
        werr.add_(flat)  # corrected = momentum + worker error, kept in the error's buffer
        scales = torch.stack([rms(werr[o:o + lay.padded(i)], n)
                              for i, (o, n) in enumerate(zip(lay.offsets, lay.numels, strict=True))])
        positive = werr >= 0
        werr.sub_(values(positive, torch.repeat_interleave(scales, b["padded"]), b["worker_mask"]))
        rows = pack_signs(positive)[b["send_order"]].view(world, width // 8)
        send = torch.cat([scales.view(torch.uint8).expand(world, 4 * t), rows], dim=1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        # phase 1, server: average the W ranks' chunks of this rank in rank order, compensate, compress again
        mask = b["row_masks"][rank]
        total = torch.zeros(width, dtype=SCALE_DTYPE, device=flat.device)
        for r in range(world):
            r_scales, r_signs = decode(recv[r], t, width)
            total.add_(values(r_signs, torch.repeat_interleave(r_scales, b["widths"]), mask))
        comp = total.div_(world).add_(self.server_error)
        server_scales = torch.stack([rms(comp[o:o + w], lay.real(i, rank))
                                     for i, (o, w) in enumerate(zip(lay.row_offsets, lay.widths, strict=True))])
        positive = comp >= 0
        self.server_error = comp.sub_(values(positive, torch.repeat_interleave(server_scales, b["widths"]), mask))
        mine = encode(server_scales, positive)
        # phase 2: every server's chunks to every rank
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=self.group)
        self.unmetered += lay.sent_bytes()
        grid = torch.stack([values(sg, torch.repeat_interleave(sc, b["widths"]), b["row_masks"][j])
                            for j, (sc, sg) in enumerate(decode(g, t, width) for g in gathered)])
        for m, o, w in zip(momenta, lay.row_offsets, lay.widths, strict=True):
            m.copy_(grid[:, o:o + w].reshape(-1)[:m.numel()].view_as(m))

    def _layout(self, numels: list[int], world: int, device: torch.device) -> ChunkLayout:
        """The layout for these tensors (built at the first exchange, with zero or loaded errors)."""
        if self.layout is not None and self.layout.numels == numels and self.layout.world == world:
            return self.layout
        lay = self.layout = ChunkLayout(numels, world)
        rank = dist.get_rank(self.group)
        self._buffers = {
            "flat": torch.zeros(world * lay.width, dtype=SCALE_DTYPE, device=device),
            "worker_mask": lay.worker_mask().to(device),
            "row_masks": lay.row_masks().to(device),
            "send_order": lay.send_order().to(device),
            "padded": torch.tensor([lay.padded(i) for i in range(len(numels))], device=device),
            "widths": torch.tensor(lay.widths, device=device),
        }
        self.worker_error = torch.zeros(world * lay.width, dtype=SCALE_DTYPE, device=device)
        self.server_error = torch.zeros(lay.width, dtype=SCALE_DTYPE, device=device)
        loaded, self._loaded = self._loaded, None
        if loaded is not None and loaded["worker_error"]:
            worker = loaded["worker_error"]
            if [int(w.numel()) for w in worker] != numels:
                raise ValueError(
                    "the checkpoint's 1-bit Adam worker error has tensors of "
                    f"{[int(w.numel()) for w in worker][:6]} elements, this run's momenta {numels[:6]}: "
                    "resume with the run's own model"
                )
            for o, n, w in zip(lay.offsets, numels, worker, strict=True):
                self.worker_error[o:o + n] = w.reshape(-1).to(device)
            if loaded["world"] == world and loaded["rank"] == rank:
                for o, s in zip(lay.row_offsets, loaded["server_error"], strict=True):
                    self.server_error[o:o + s.numel()] = s.to(device)
        return lay

    # ---------------------------------------------------------------- checkpoints (per rank)
    def state_dict(self) -> dict[str, Any]:
        """The errors of this rank, per tensor (the worker error without padding, the server error
        as this rank's chunk of each), the layout's world size and this rank; `steps_done` lives in
        the optimizer's state."""
        if self.layout is None and self._loaded is not None:  # loaded, not used yet: save it as it came
            return {"kind": "onebit_adam", **self._loaded}
        lay = self.layout
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        if lay is None:
            return {"kind": "onebit_adam", "world": self.world, "rank": rank, "worker_error": [], "server_error": []}
        return {
            "kind": "onebit_adam", "world": lay.world, "rank": rank,
            "worker_error": [self.worker_error[o:o + n].detach().cpu().clone()
                             for o, n in zip(lay.offsets, lay.numels, strict=True)],
            "server_error": [self.server_error[o:o + w].detach().cpu().clone()
                             for o, w in zip(lay.row_offsets, lay.widths, strict=True)],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Keep the errors until the first exchange lays them out (the worker error at any world
        size; the server error only at the world size and rank it was saved at, else from zero)."""
        self._loaded = {k: sd[k] for k in ("world", "rank", "worker_error", "server_error")}
        self.layout, self.worker_error, self.server_error = None, torch.zeros(0), torch.zeros(0)


# ------------------------------------------------------------------------------- the DDP hook
def warmup_hook(state: MomentumExchange, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Warm-up: average the bucket over the group (DDP's own reduction). After `freeze_step`
    optimizer steps: nothing is sent, each rank keeps its local gradient (the optimizer exchanges
    the momentum instead)."""
    buffer, index = bucket.buffer(), bucket.index()
    if state.compressing:
        state.last_payload[index] = 0
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    state.last_payload[index] = buffer.numel() * buffer.element_size()
    world = dist.get_world_size(state.group)
    reduced = dist.all_reduce(buffer.div_(world), group=state.group, async_op=True).get_future()
    return reduced.then(lambda f: f.value()[0])
