"""Tests for the built-in models (LLaMA-style LM, toy MLP) and generate/load helpers."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from safetensors.torch import save_file

from dptrain.cli.generate import generate, generate_bytes, import_object, load_model_from_run
from dptrain.models import LlamaLM, build_llama, build_mlp, build_regression_data

pytestmark = [pytest.mark.timeout(60), pytest.mark.fast]

TINY = dict(dim=32, n_layers=2, n_heads=4, max_seq_len=64)


def tiny(seed: int = 0, **kw) -> LlamaLM:
    torch.manual_seed(seed)
    return build_llama(**{**TINY, **kw})


def tokens(b: int = 2, t: int = 16, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_default_sizes():
    m = tiny()
    x = tokens(3, 17)
    assert m.logits(x).shape == (3, 17, 256)
    assert m(tokens(3, 18)).shape == ()
    assert isinstance(m.layers, torch.nn.ModuleList) and len(m.layers) == 2
    blk = m.layers[0]
    for name in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3"):
        assert isinstance(blk.get_submodule(name), torch.nn.Linear)
    # LLaMA ffn rule: 2/3 * 4 * 128 = 341 -> 352 (multiple of 32)
    assert build_llama().layers[0].mlp.w1.out_features == 352


def test_loss_at_init_near_uniform():
    loss = tiny()(tokens(4, 33))
    assert abs(loss.item() - math.log(256)) < 0.3


def test_causality():
    m = tiny().eval()
    x = tokens(1, 20)
    y = x.clone()
    y[0, 12] = (y[0, 12] + 1) % 256
    a, b = m.logits(x), m.logits(y)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_rope_buffers_not_in_state_dict():
    m = tiny()
    assert not any("rope" in k for k in m.state_dict())
    assert {n for n, _ in m.named_buffers()} == {"rope_cos", "rope_sin"}


def test_deterministic_init():
    a, b, c = tiny(seed=3), tiny(seed=3), tiny(seed=4)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_output_projection_init_scaled():
    m = build_llama(dim=256, n_layers=8)
    assert abs(m.layers[0].attn.wq.weight.std().item() - 0.02) < 0.002
    assert abs(m.layers[0].attn.wo.weight.std().item() - 0.02 / 4) < 0.001


def test_bf16_autocast_forward_backward():
    m = tiny()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(tokens(2, 17))
        logits = m.logits(tokens(2, 16))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert logits.dtype == torch.bfloat16
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.timeout(240)  # a few hundred optimizer steps: slow on a loaded 2-core machine
def test_overfits_one_batch():
    m = tiny()
    batch = tokens(2, 33)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    first = None
    for _ in range(50):
        loss = m(batch)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.3 * first


def test_dict_batch_with_ignored_labels():
    m = tiny()
    seq = tokens(2, 17)
    inputs, labels = seq[:, :-1], seq[:, 1:].clone()
    torch.testing.assert_close(m(input_ids=inputs, labels=labels), m(seq))
    torch.testing.assert_close(m((inputs, labels)), m(seq))
    # Ignoring positions must equal the mean CE over the kept positions only.
    labels[:, :8] = -100
    logits = m.logits(inputs)
    ref = torch.nn.functional.cross_entropy(logits[:, 8:].reshape(-1, 256), seq[:, 9:].reshape(-1))
    torch.testing.assert_close(m(input_ids=inputs, labels=labels), ref)


def test_gqa():
    m = tiny(n_heads=4, n_kv_heads=2)
    assert m.layers[0].attn.wk.out_features == 2 * 8
    loss = m(tokens(2, 17))
    assert torch.isfinite(loss)
    loss.backward()
    with pytest.raises(ValueError):
        build_llama(dim=32, n_heads=4, n_kv_heads=3)


def test_tied_embeddings():
    m = tiny(tie_embeddings=True)
    assert m.head.weight is m.tok_emb.weight
    assert m.num_params() == tiny().num_params() - 256 * 32
    assert torch.isfinite(m(tokens(2, 17)))


def test_num_params_and_flops():
    m = tiny()
    n = sum(p.numel() for p in m.parameters())
    assert m.num_params() == n
    assert m.num_params(exclude_embedding=True) == n - 256 * 32
    assert m.flops_per_token(64) == 6 * (n - 256 * 32) + 12 * 2 * 32 * 64


def test_seq_len_limit_and_meta_init():
    m = tiny()
    with pytest.raises(ValueError):
        m.logits(tokens(1, 65))
    # Deferred init: build on meta, materialise, then init_weights() must also rebuild rope.
    with torch.device("meta"):
        meta = build_llama(**TINY)
    meta.to_empty(device="cpu")
    torch.manual_seed(0)
    meta.init_weights()
    torch.testing.assert_close(meta.rope_cos, m.rope_cos)
    assert abs(meta(tokens(2, 17)).item() - math.log(256)) < 0.3


def test_rope_tables_rebuilt_after_dtype_cast():
    m = tiny().to(torch.bfloat16)
    assert m.rope_cos.dtype == torch.bfloat16
    m.logits(tokens(1, 8))
    assert m.rope_cos.dtype == torch.float32


def test_fsdp2_world_size_one(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs a fresh torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        m, ref = tiny(), tiny()
        mesh = init_device_mesh("cpu", (1,))
        for layer in m.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        register_fsdp_forward_method(m, "logits")
        batch = tokens(2, 17)
        loss = m(batch)
        torch.testing.assert_close(loss, ref(batch))
        loss.backward()
        assert m.num_params() == ref.num_params()
        assert m.logits(batch[:, :-1]).shape == (2, 16, 256)
    finally:
        dist.destroy_process_group()


def test_toy_mlp_and_data():
    torch.manual_seed(0)
    m = build_mlp(in_dim=16, hidden=32, out_dim=4, depth=3)
    assert len(m.layers) == 3
    ds = build_regression_data(n=64, seed=5)
    assert len(ds) == 64
    x, y = ds[0]
    assert x.shape == (16,) and y.shape == (4,) and x.dtype == y.dtype == torch.float32
    xb, yb = ds.x[:8], ds.y[:8]
    loss = m((xb, yb))
    assert loss.shape == () and torch.isfinite(loss)
    torch.testing.assert_close(m({"x": xb, "y": yb}), loss)
    torch.testing.assert_close(m([xb, yb]), loss)
    # Deterministic data and init; the global RNG does not influence the data.
    torch.manual_seed(123)
    ds2 = build_regression_data(n=64, seed=5)
    assert torch.equal(ds.x, ds2.x) and torch.equal(ds.y, ds2.y)
    assert not torch.equal(ds.x, build_regression_data(n=64, seed=6).x)
    torch.manual_seed(0)
    m2 = build_mlp(in_dim=16, hidden=32, out_dim=4, depth=3)
    assert all(
        torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True)
    )


def test_toy_mlp_learns():
    torch.manual_seed(0)
    m = build_mlp()
    ds = build_regression_data(n=256)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    first = m((ds.x, ds.y)).item()
    for _ in range(100):
        loss = m((ds.x, ds.y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first


def test_generate():
    m = tiny(vocab_size=128)  # ASCII-only vocab: every byte decodes to exactly one character
    out = generate(m, "hello", max_new_tokens=30, seed=1)
    assert isinstance(out, str) and len(out) == 30
    assert out == generate(m, b"hello", max_new_tokens=30, seed=1)
    assert m.training  # training mode restored
    # Full byte vocab, prompt longer than the context window, greedy and unfiltered modes.
    big = tiny()
    raw = generate_bytes(big, "x" * 100, max_new_tokens=10, temperature=0.0)
    assert isinstance(raw, bytes) and len(raw) == 10
    assert len(generate_bytes(big, "", max_new_tokens=5, top_k=None)) == 5
    assert isinstance(generate(big, "hi", max_new_tokens=20), str)


def test_import_object():
    assert import_object("dptrain.models.llama:build_llama") is build_llama
    assert import_object("dptrain.models.llama.build_llama") is build_llama
    assert import_object("dptrain.models.llama:LlamaLM.forward") is LlamaLM.forward
    with pytest.raises(ValueError):
        import_object("nodots")


@pytest.mark.parametrize("tie", [False, True])
def test_load_model_from_run_round_trip(tmp_path, tie):
    kwargs = {**TINY, "tie_embeddings": tie}
    m = tiny(**kwargs)
    cfg = {"model": {"factory": "dptrain.models.llama:build_llama", "kwargs": kwargs}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "final").mkdir()
    state = {k: v.contiguous() for k, v in m.state_dict().items()}
    if tie:
        del state["head.weight"]  # safetensors cannot store aliased tensors
    save_file(state, str(tmp_path / "final" / "model.safetensors"))
    torch.manual_seed(99)  # the reload must not depend on the init seed
    loaded = load_model_from_run(tmp_path)
    x = tokens(2, 16)
    torch.testing.assert_close(loaded.logits(x), m.logits(x))
    assert not loaded.training
