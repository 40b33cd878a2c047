"""optim.name=onebit_adam (1-bit Adam): the compression math and its error-feedback invariants, the
warm-up against torch's AdamW and the frozen-variance stage against plain tensor math, the two-phase
compressed all-reduce on 2 gloo ranks against a one-process simulation of both ranks (bitwise), the
run through the Trainer (warm-up bit-identical to AdamW, bytes per step, identical replicas) and a
resume after the freeze bit-identical to the uninterrupted run, the refusals and the DeepSpeed mapping."""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from dptrain.config import ConfigError, resolve
from dptrain.config.deepspeed import from_deepspeed, translate_deepspeed
from dptrain.config.load import build_config, load_config
from dptrain.parallel import momentum_exchange as oba
from dptrain.train.onebit_adam import OneBitAdam
from support import overrides
from support.mp import in_group, run_ranks

SHAPES = [(1,), (7,), (33,), (5, 13), (100,), (2, 3, 4)]
"""Odd sizes: one element (a server chunk of pure padding on rank 1), partial bytes, a 3-D tensor."""


def momenta(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = [torch.randn(s, generator=g) for s in SHAPES]
    out[2][5] = 0.0  # an exact zero: the sign bit says + (>= 0)
    return out


# ------------------------------------------------------------------ the reference: both ranks in one process
def _put(errors: list[torch.Tensor], i: int, value: torch.Tensor) -> None:
    if len(errors) > i:
        errors[i] = value
    else:
        errors.append(value)


def reference_exchange(inputs: list[list[torch.Tensor]], worker: list[list[torch.Tensor]],
                       server: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """One compressed all-reduce of W ranks' momenta (inputs[rank][tensor]), written as the paper's
    two phases with plain tensor math; updates the ranks' errors (padded worker errors, per-chunk
    server errors; empty lists are zero) in place and returns the averaged momenta every rank gets."""
    world = len(inputs)
    out = []
    for i in range(len(inputs[0])):
        n = inputs[0][i].numel()
        c = math.ceil(n / (8 * world)) * 8  # each server's chunk: whole bytes of signs
        decompressed = []
        for r in range(world):
            x = torch.zeros(c * world)
            x[:n] = inputs[r][i].reshape(-1)
            if len(worker[r]) > i:
                x += worker[r][i]
            scale = torch.linalg.vector_norm(x) / math.sqrt(n)
            d = torch.where(x >= 0, scale, -scale)
            d[n:] = 0
            _put(worker[r], i, x - d)
            decompressed.append(d)
        result = torch.zeros(c * world)
        for j in range(world):  # rank j serves chunk j
            real = max(0, min(c, n - j * c))
            total = torch.zeros(c)
            for r in range(world):
                total += decompressed[r][j * c:(j + 1) * c]
            comp = total / world
            if len(server[j]) > i:
                comp = comp + server[j][i]
            scale = torch.linalg.vector_norm(comp) / math.sqrt(max(real, 1))
            d = torch.where(comp >= 0, scale, -scale)
            d[real:] = 0
            _put(server[j], i, comp - d)
            result[j * c:(j + 1) * c] = d
        out.append(result[:n].view(inputs[0][i].shape))
    return out


# ------------------------------------------------------------------ single process: the math
@pytest.mark.fast
@pytest.mark.timeout(30)
def test_chunk_layout_covers_every_element_once_in_whole_bytes():
    for world in (1, 2, 3, 8):
        lay = oba.ChunkLayout([1, 7, 64, 1000, 4097], world)
        assert all(w % 8 == 0 for w in lay.widths) and lay.width == sum(lay.widths)
        for i, n in enumerate(lay.numels):
            assert lay.padded(i) >= n and lay.padded(i) - n < 8 * world
            assert sum(lay.real(i, j) for j in range(world)) == n
        assert lay.sent_bytes() == 2 * (world - 1) * (4 * 5 + lay.width // 8)


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_compression_keeps_signs_and_norm_and_leaves_padding_alone():
    x = torch.zeros(24)
    x[:19] = torch.randn(19, generator=torch.Generator().manual_seed(0))
    x[3] = 0.0
    scale, positive, error = oba.compress(x, 19)
    decompressed = x - error
    assert torch.equal(positive[:19], x[:19] >= 0) and bool(positive[3])  # zero counts as +
    # the RMS scale keeps the norm (the paper's and DeepSpeed's choice)
    assert torch.allclose(torch.linalg.vector_norm(decompressed), torch.linalg.vector_norm(x), rtol=1e-6)
    assert torch.allclose(decompressed[:19].abs(), scale.expand(19), rtol=1e-6)
    assert torch.equal(error[19:], torch.zeros(5))  # padding carries nothing
    assert oba.compress(torch.zeros(8), 0)[0] == 0  # a chunk of pure padding: scale 0, not nan
    msg = oba.encode(torch.tensor([scale, 2.5]), positive)
    assert msg.numel() == 8 + 3
    got_scales, got_signs = oba.decode(msg, 2, 24)
    assert torch.equal(got_scales, torch.tensor([scale, 2.5])) and torch.equal(got_signs, positive)


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_error_feedback_sends_everything_eventually():
    # EF invariant: after T steps, sum of what was sent + the error left = sum of the inputs, so the
    # mean of what was sent converges to the mean input at rate |error| / T (the error stays bounded)
    g = torch.Generator().manual_seed(1)
    error, sent, given = torch.zeros(40), torch.zeros(40), torch.zeros(40)
    norms = []
    for _ in range(300):
        x = torch.randn(40, generator=g) * 0.1 + torch.linspace(-1, 1, 40)
        scale, positive, error = oba.compress(x + error, 40)
        sent += torch.where(positive, scale, -scale)
        given += x
        norms.append(float(torch.linalg.vector_norm(error)))
    assert torch.allclose(sent + error, given, atol=1e-3)
    assert max(norms[100:]) < 4 * max(norms[:100])  # bounded, not growing
    assert torch.allclose(sent / 300, given / 300, atol=0.05)


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((6, 5), (5,), (3, 6))]


def _grads(step: int, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_warmup_is_torchs_adamw_bit_for_bit():
    ours, theirs = _params(), _params()
    kw = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8}
    def groups(ps: list[torch.nn.Parameter]) -> list[dict]:
        return [{"params": ps[::2], "weight_decay": 0.1}, {"params": ps[1:2], "weight_decay": 0.0}]

    opt = OneBitAdam(groups(ours), freeze_step=50, **kw)
    ref = torch.optim.AdamW(groups(theirs), foreach=False, **kw)
    for step in range(12):
        for o in (opt, ref):
            for group in o.param_groups:
                group["lr"] = 0.01 * (step + 1) / 12  # a schedule, as LambdaLR would set it
        for p, q, g in zip(ours, theirs, _grads(step, ours), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        assert all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True)), step
    assert opt.steps_done() == 12
    sd, rd = opt.state_dict()["state"], ref.state_dict()["state"]
    assert all(torch.equal(sd[k][f], rd[k][f]) for k in sd for f in ("step", "exp_avg", "exp_avg_sq"))


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_after_the_freeze_the_variance_stays_and_the_momentum_goes_on():
    params, freeze, lr, b1, b2, eps, wd = _params(), 3, 0.02, 0.9, 0.99, 1e-8, 0.05
    ref = [p.detach().clone() for p in params]
    opt = OneBitAdam([{"params": params, "weight_decay": wd}], lr=lr, betas=(b1, b2), eps=eps, freeze_step=freeze)
    m = [torch.zeros_like(p) for p in ref]
    v = [torch.zeros_like(p) for p in ref]
    for step in range(1, 9):
        grads = _grads(step, params)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):  # Adam with the variance frozen after step `freeze`, plain tensor math
            ref[i] = ref[i] * (1 - lr * wd)
            m[i] = b1 * m[i] + (1 - b1) * g
            if step <= freeze:
                v[i] = b2 * v[i] + (1 - b2) * g * g
            t_v = min(step, freeze)
            ref[i] = ref[i] - lr / (1 - b1**step) * m[i] / ((v[i] / (1 - b2**t_v)).sqrt() + eps)
        assert all(torch.allclose(p, r, rtol=1e-6, atol=1e-7) for p, r in zip(params, ref, strict=True)), step
    assert torch.allclose(opt.state[params[0]]["exp_avg_sq"], v[0], rtol=1e-6)


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_freeze_step_below_one_is_refused():
    with pytest.raises(ValueError, match="freeze_step=0 must be at least 1"):
        OneBitAdam(_params(), freeze_step=0)


# ------------------------------------------------------------------ 2 gloo ranks: the exchange
def _exchange_ranks(rank: int, steps: int, cut: int) -> dict:
    def body() -> dict:
        import torch.distributed as dist

        ex = oba.MomentumExchange(None, freeze_step=1)
        got, saved, resumed = [], None, []
        for step in range(steps):
            m = momenta(rank, step)
            ex.allreduce(m)
            got.append(m)
            if step + 1 == cut:
                saved = copy.deepcopy(ex.state_dict())
        fresh = oba.MomentumExchange(None, freeze_step=1)  # a resumed run: the saved errors, then the same steps
        fresh.load_state_dict(saved)
        for step in range(cut, steps):
            m = momenta(rank, step)
            fresh.allreduce(m)
            resumed.append(m)
        assert dist.get_backend() == "gloo"
        assert ex.layout is not None
        lay = ex.layout
        padding_zero = all(not ex.worker_error[o + n:o + lay.padded(i)].any()
                           for i, (o, n) in enumerate(zip(lay.offsets, lay.numels, strict=True)))
        return {"got": got, "state": ex.state_dict(), "padding_zero": padding_zero, "saved": saved, "resumed": resumed,
                "sent": ex.take_sent(), "bytes": ex.layout.sent_bytes()}

    return in_group(body)


@pytest.mark.timeout(90)
def test_compressed_allreduce_on_two_gloo_ranks_equals_the_one_process_simulation_bitwise():
    steps, cut = 4, 2
    out = run_ranks(_exchange_ranks, 2, steps, cut, timeout=80)
    worker: list[list[torch.Tensor]] = [[], []]
    server: list[list[torch.Tensor]] = [[], []]
    for step in range(steps):
        want = reference_exchange([momenta(0, step), momenta(1, step)], worker, server)
        for r in range(2):
            for t, (a, b) in enumerate(zip(out[r]["got"][step], want, strict=True)):
                assert torch.equal(a, b), (step, r, t, (a - b).abs().max())
    for r in range(2):  # the errors each rank keeps are the simulation's, bitwise (worker saved without padding)
        st = out[r]["state"]
        assert st["world"] == 2 and st["rank"] == r
        assert all(torch.equal(a, b[:a.numel()]) for a, b in zip(st["worker_error"], worker[r], strict=True))
        assert out[r]["padding_zero"]  # the padded elements of the live worker error hold nothing
        assert all(torch.equal(a, b) for a, b in zip(st["server_error"], server[r], strict=True))
        # a rank's errors really differ from the other's, and are not all zero
        assert any(e.abs().sum() > 0 for e in st["server_error"])
    assert not all(torch.equal(a, b) for a, b in zip(out[0]["state"]["worker_error"], out[1]["state"]["worker_error"],
                                                        strict=True))
    # resumed from the errors saved after step `cut`: the same momenta as the uninterrupted exchange
    for r in range(2):
        for a, b in zip(out[r]["resumed"], out[r]["got"][cut:], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # bytes: 2 (W - 1) messages of 4 T scale bytes + C / 8 sign bytes per exchange
    lay = oba.ChunkLayout([math.prod(s) for s in SHAPES], 2)
    assert out[0]["bytes"] == lay.sent_bytes() == 2 * (4 * len(SHAPES) + lay.width // 8)
    assert out[0]["sent"] == steps * lay.sent_bytes()


# ------------------------------------------------------------------ 2 gloo ranks: the Trainer
TOY = [
    "model.factory=dptrain.models.toy:build_mlp", "model.kwargs={}",
    "data.factory=dptrain.models.toy:build_regression_data", "data.kwargs={}",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every_steps=1", "train.eval_every_steps=0",
    "optim.lr=0.01", "optim.warmup_steps=0", "optim.schedule=constant", "optim.grad_clip=1.0",
    "log.progress=false", "checkpoint.keep_last=null", "diagnostics.preflight=false",
]


def fit(rank: int, out: Path, extra: list[str]) -> dict:
    from dptrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides(TOY, extra)), out_dir=out)
    trainer.fit()
    weights = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in trainer.module.parameters()))
    result = {"weights": weights.hexdigest(), "hook": None if trainer.comm_hook is None else trainer.comm_hook.name}
    del trainer
    gc.collect()
    return result


def records(run_dir: Path) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r]


def losses(run_dir: Path) -> list[str]:
    return [float.hex(r["loss"]) for r in records(run_dir)]


@pytest.mark.timeout(150)
def test_two_rank_run_warms_up_as_adamw_then_sends_bits_and_resumes_bit_identically(tmp_path):
    one = ["optim.name=onebit_adam", "optim.freeze_step=2"]
    adamw = run_ranks(fit, 2, tmp_path / "adamw", ["optim.name=adamw", "train.max_steps=3"], timeout=60)
    ref = run_ranks(fit, 2, tmp_path / "ref", [*one, "train.max_steps=7"], timeout=60)
    assert adamw[0]["hook"] is None and ref[0]["hook"] == "onebit_adam"
    # the warm-up is AdamW on DDP's averaged gradients: the loss of step 3 (after 2 updates) is AdamW's, bitwise
    assert losses(tmp_path / "ref")[:3] == losses(tmp_path / "adamw")
    assert ref[0]["weights"] == ref[1]["weights"]  # every rank applied the same compressed update
    recs = records(tmp_path / "ref")
    grad_bytes = recs[0]["comm_bytes"]  # an fp32 all-reduce on 2 ranks: 2 (n - 1) / n x 4 bytes per element
    toy_numels = [p.numel() for p in _toy_params()]
    assert grad_bytes == 4 * sum(toy_numels)
    lay = oba.ChunkLayout(toy_numels, 2)
    assert [r["comm_bytes"] for r in recs] == [grad_bytes] * 2 + [lay.sent_bytes()] * 5
    # cut after the freeze (errors in play), resume, finish: bit-identical to the uninterrupted run
    run_ranks(fit, 2, tmp_path / "cut", [*one, "train.max_steps=4"], timeout=60)
    cut = run_ranks(fit, 2, tmp_path / "cut", [*one, "train.max_steps=7"], timeout=60)
    assert losses(tmp_path / "cut") == losses(tmp_path / "ref")
    assert cut[0]["weights"] == ref[0]["weights"] and cut[1]["weights"] == ref[1]["weights"]
    step4 = tmp_path / "cut" / "checkpoints" / "step_000004"
    saved = [torch.load(step4 / f"rank_0000{r}.pt", weights_only=True)["comm_hook"] for r in range(2)]
    assert all(s["kind"] == "onebit_adam" and s["worker_error"] and s["server_error"] for s in saved)
    assert not torch.equal(saved[0]["worker_error"][0], saved[1]["worker_error"][0])  # per rank


def _toy_params() -> list[torch.nn.Parameter]:
    from dptrain.models.toy import build_mlp

    return list(build_mlp().parameters())


# ------------------------------------------------------------------ config and DeepSpeed
@pytest.mark.fast
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("extra", "world", "message"),
    [
        (["parallel.strategy=zero1"], 2, "needs parallel.strategy=ddp"),
        (["parallel.strategy=fsdp"], 2, "needs parallel.strategy=ddp"),
        (["parallel.grad_compression=onebit"], 2, "set parallel.grad_compression=none"),
        (["parallel.tp=2"], 4, "plain DDP only"),
        (["optim.freeze_step=0"], 2, "optim.freeze_step=0 is not valid"),
    ],
)
def test_refusals_name_the_value_and_the_reason(extra, world, message):
    with pytest.raises(ConfigError) as err:
        resolve(load_config(None, ["optim.name=onebit_adam", *extra]), world_size=world, cuda_available=False)
    assert message in str(err.value)


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_deepspeed_onebitadam_maps_to_onebit_adam():
    ds = {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 2e-4, "freeze_step": 400, "cuda_aware": False,
                                                        "comm_backend_name": "nccl", "weight_decay": 0.01}},
    }
    m = translate_deepspeed(ds)
    cfg = build_config(m.config)
    o = cfg.optim
    assert (o.name, o.lr, o.freeze_step, o.weight_decay, tuple(o.betas), o.eps) == (
        "onebit_adam", 2e-4, 400, 0.01, (0.9, 0.999), 1e-8)
    resolve(cfg, world_size=2, cuda_available=False)
    assert any("OneBitAdam" in n for n in m.notes)  # DeepSpeed's own first step and bias correction differ
    assert {"optimizer.params.cuda_aware", "optimizer.params.comm_backend_name"} <= set(m.ignored)
    no_freeze, _ = from_deepspeed({**ds, "optimizer": {"type": "OnebitAdam", "params": {}}})
    assert build_config(no_freeze).optim.freeze_step == 100000  # DeepSpeed's default
