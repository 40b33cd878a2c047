"""The configuration tree: frozen dataclasses with one docstring per field.

A run is described by a `Config` whose sections are plain frozen dataclasses. Loading
(YAML, DeepSpeed JSON, `section.field=value` overrides) lives in `config/load.py` and
`config/deepspeed.py`; the
validation and the values derived for a world size (batch sizes, scaled learning rate)
live in `config/resolve.py`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

# The `parallel` section lives in parallel_fields.py and the run-operation sections in run_fields.py; imported here
# for `Config` and for `from dptrain.config.fields`.
from dptrain.config.parallel_fields import ParallelConfig  # noqa: F401
from dptrain.config.run_fields import CheckpointConfig, DiagnosticsConfig, LaunchConfig, LogConfig  # noqa: F401


class ConfigError(ValueError):
    """A config value is invalid; the message names the value and what would be valid."""


STRATEGIES = ("single", "dp", "ddp", "zero1", "zero2", "fsdp")
DTYPES = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adamw", "adam", "onebit_adam", "lamb", "onebit_lamb")
LR_SCALINGS = ("none", "linear", "sqrt")
RANK_SPLITS = ("contiguous", "interleaved")
"""How a global batch is shared among the data-parallel ranks (data.rank_split, GlobalBatchSampler)."""
SCHEDULES = ("cosine", "constant", "linear", "onecycle", "lr_range_test")
LOSS_SCALERS = ("torch", "deepspeed")
NONFINITE_POLICIES = ("skip", "error", "off")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective", "selective_torchtitan")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
MP_DTYPES = ("fp32", "bf16", "fp16")
WARMUP_TYPES = ("linear", "log")
SCHEDULE_CONVENTIONS = ("dptrain", "deepspeed")
GRAD_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "onebit")
DEFAULT_BATCH = (32, 8)
"""(global, micro) used when none of the three batch fields is given (the built-in recipe)."""


LLAMA_RECIPE_KWARGS: dict[str, Any] = {"dim": 128, "n_layers": 4, "n_heads": 4, "max_seq_len": 128}
"""The built-in recipe's model.kwargs (a pretrained folder's config.json replaces them: dptrain/models/llama.py)."""


def _llama_defaults() -> dict[str, Any]:
    return dict(LLAMA_RECIPE_KWARGS)


def _corpus_defaults() -> dict[str, Any]:
    return {"seq_len": 128}


@dataclass(frozen=True)
class LoraConfig:
    enabled: bool = False
    """Train LoRA adapters (peft's `get_peft_model`; needs the `lora` extra: pip install 'dptrain[lora]') on the
    model the factory returns, a Hugging Face model or the built-in LLaMA, instead of all its weights: the base is
    frozen (no gradients, optimizer state or gradient all-reduce), checkpoints hold the adapters and the base's
    identity, final/ is PEFT's adapter_model.safetensors + adapter_config.json. A factory that returns a PEFT model
    itself needs none of this section. See docs/guides/lora.md."""
    rank: int = 8
    """The adapters' rank r (peft's LoraConfig.r): each targeted W (out x in) gets B (out x r) @ A (r x in)."""
    alpha: float = 16.0
    """LoRA's alpha (peft's lora_alpha): the adapters' output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input (peft's lora_dropout), in [0, 1)."""
    target_modules: tuple[str, ...] | None = None
    """Names of the linear layers that get adapters (peft's target_modules: a module whose name is one of these or
    ends with '.NAME'); null: every attention and MLP linear (the built-in LLaMA: wq, wk, wv, wo, w1, w2, w3;
    a Hugging Face model: each nn.Linear but its output head), never the output head. A name that matches no module is
    refused, naming the linears the model has."""


@dataclass(frozen=True)
class ModelConfig:
    factory: str = "dptrain.models.llama:build_llama"
    """Import path `pkg.mod:fn` of a function returning an `nn.Module` (called with `kwargs`)."""
    kwargs: dict[str, Any] = field(default_factory=_llama_defaults)
    """Keyword arguments passed to the model factory."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the factory's model (model.lora.enabled=true; the fields below)."""


@dataclass(frozen=True)
class DataConfig:
    factory: str = "dptrain.data.corpus:build_stdlib_lm"
    """Import path of a function returning a map-style Dataset, or a (train, val) pair."""
    kwargs: dict[str, Any] = field(default_factory=_corpus_defaults)
    """Keyword arguments passed to the data factory."""
    source: str | None = None
    """Shorthand that picks the data factory from what the path is: a folder written by `dptrain data prepare` ->
    packed pre-training rows (dptrain.data.packed:build_packed), a JSON-lines file -> fine-tuning/classification rows
    with dynamic padding under a token budget (dptrain.data.finetune:build_finetune); the path becomes
    data.kwargs.source. Checked when the config loads (a ConfigError names the value). See docs/guides/own-data.md."""
    collate: str | None = None
    """Optional import path `pkg.mod:fn` of a collate function (default: the training dataset's own `collate` method if
    it has one, as packed rows do, else torch's default_collate). Any importable
    callable: with `collate_kwargs` it is called as fn(samples, **collate_kwargs) (functools.partial). A closure: name
    a module-level result of your factory (`collate = make_collate(...)` in pkg/mod.py); see
    docs/guides/models-and-data.md."""
    collate_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments bound to `collate` (functools.partial(collate, **collate_kwargs)); must bind its signature."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0 loads in the training process)."""
    pin_memory: bool = True
    """Pin host memory for faster host-to-GPU copies (ignored without CUDA)."""
    shuffle: bool = True
    """Shuffle the global sample order; it is reshuffled every epoch from `train.seed`."""
    rank_split: str = "contiguous"
    """How each global batch is shared among the data-parallel ranks: "contiguous" (rank r takes the r-th slice) or
    "interleaved" (every W-th sample from position r: torch's DistributedSampler's share of the same order, so a
    ported DDP script whose per-rank batches matter, as with BatchNorm, matches its original). Fixed-size batches
    only (not a token-budget data.source). See docs/guides/porting.md."""
    persistent_workers: bool = True
    """With num_workers > 0: keep the worker processes between iterations of the loader (DataLoader's
    persistent_workers). dptrain iterates its training loader once (the sampler is endless), so this only matters to
    code that iterates it again; ignored with num_workers=0."""
    prefetch_factor: int | None = None
    """With num_workers > 0: micro-batches each worker loads ahead (DataLoader's prefetch_factor); null: the
    DataLoader's default (2). Refused with num_workers=0, where nothing loads ahead."""


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 500
    """Number of optimizer steps to train."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all ranks = micro_batch_size * grad_accum_steps * dp world size. Any batch field
    left out is derived from the others (DeepSpeed's rules: accum 1 when only one size is given); none given: global 32,
    micro 8."""
    micro_batch_size: int | None = None
    """Samples per forward/backward on one rank (derived when left out; see global_batch_size)."""
    grad_accum_steps: int | None = None
    """Micro-steps per optimizer step (derived when left out; see global_batch_size)."""
    seed: int = 1234
    """Seed for model initialisation and the data order (the same on every rank)."""
    log_every_steps: int = 10
    """Log metrics (and read the loss off the device) every N steps."""
    eval_every_steps: int = 100
    """Evaluate on the validation split every N steps (0: only at the start and the end)."""
    eval_batches: int = 8
    """Micro-batches per rank in one evaluation."""
    loss: str | None = None
    """Import path `pkg.mod:fn(model, batch) -> loss`; by default the model's forward returns the loss."""
    loss_chunk_tokens: int | None = None
    """A causal LM's training loss in chunks of this many tokens, the output projection and the cross-entropy fused
    (dptrain/models/chunked_loss.py): the whole [tokens, vocabulary] logits, their log-softmax and their gradient
    never exist at once; each chunk's logits are recomputed in backward. Exact (loss and gradients equal to the
    unchunked path within float32 rounding). It applies with the default loss (no train.loss) to the built-in LLaMA
    and to transformers causal LMs with the common forward (Llama, Mistral, Qwen2/3, Gemma, Phi-3, OLMo, ...; also
    in a PEFT wrapper) and an nn.Linear head, without tensor or pipeline parallelism; other models keep their own
    loss. null: as many tokens as keep a chunk's float32 logits within 32 MiB (256 at a vocabulary of 32,000);
    0: off, the model's own loss over the whole logits. A micro-batch of at most one chunk of tokens with a trained
    head, and evaluation, keep the model's own path (bit for bit); a frozen transformers head (LoRA) is always
    chunked, so that backward needs no gathered head under fsdp."""
    eval_fn: str | None = None
    """Import path `pkg.mod:fn(model, batch) -> {name: value}` of evaluation metrics beyond the loss: each value the
    batch's mean of a per-sample quantity (accuracy: (pred == y).float().mean()). dptrain weights each by the batch's
    sample count, sums over batches and data-parallel ranks and logs `eval_NAME` = sum / samples beside val_loss in
    metrics.jsonl and the console (no sample counted twice or dropped)."""
    eval_summary: str | None = None
    """Import path `pkg.mod:fn(metrics) -> {name: value}` of metrics that are not a mean over samples, computed from
    eval_fn's aggregated means (exact over the evaluation set): binary F1 = 2*tp / (2*tp + fp + fn) from the means of
    per-sample tp, fp and fn indicators. Its values are logged as `eval_NAME` beside eval_fn's."""
    eval_samples: int | None = None
    """Samples one evaluation covers: the first N of the validation set (-1: all of it), split into contiguous,
    possibly uneven shards over the data-parallel ranks, the loss and eval_fn's metrics weighted by sample count, so
    the result is the same at every world size; null: eval_batches micro-batches per rank."""
    flops_per_token: float | None = None
    """Training FLOPs per token (forward + backward) for MFU; null: the model's own `flops_per_token(seq_len)` (the
    built-in LLaMA: 6N + 12*L*d*T), else the 6N approximation (N: parameters less input embeddings)."""
    compile: bool = False
    """torch.compile each block (the FSDP units: `_no_split_modules` classes, else nn.ModuleList members) in place,
    after tensor parallelism and activation checkpointing and before FSDP2/DDP (torchtitan's order); parameter names and
    checkpoints are unchanged. The first step(s) include the compilation. Not with parallel.pp > 1."""
    compile_backend: str = "inductor"
    """train.compile: the torch.compile backend: inductor (generates C++ on the CPU, so it needs a C++ compiler: g++ or
    $CXX), aot_eager or eager (no code generation; for debugging)."""
    tf32: bool | None = None
    """CUDA: let fp32 matmuls and cuDNN convolutions use TF32 tensor cores (torch.set_float32_matmul_precision('high'),
    torch.backends.cudnn.allow_tf32); null: on with CUDA. Ignored on the CPU."""
    cudnn_benchmark: bool | None = None
    """CUDA: torch.backends.cudnn.benchmark (time the convolution algorithms for each new input shape and keep the
    fastest; results may differ in the last bits between runs); null: on with CUDA. Ignored on the CPU."""
    malloc_mmap_threshold_kib: int | None = 1024
    """Linux with glibc: allocations of at least this many KiB (host tensors) get their own memory map, returned to the
    system when freed (glibc's mallopt M_MMAP_THRESHOLD, set by each worker at start). glibc otherwise raises this
    threshold to up to 32 MiB as large blocks are freed, and its heap keeps what training frees: fine-tuning a 230M
    model under fsdp then peaked at 3.84 GB per rank instead of 2.90 GB (benchmarks/memory/finetune_memory.py).
    null: glibc's own dynamic threshold. A MALLOC_MMAP_THRESHOLD_ in the environment wins; other C libraries:
    nothing is set."""


@dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"
    """Optimizer: sgd, adamw, adam, onebit_adam, lamb or onebit_lamb (not used with `factory`). onebit_adam is 1-bit
    Adam (Tang et al. 2021): AdamW for `freeze_step` steps, then the variance is frozen and DDP sends no gradients;
    the momentum is exchanged in 1 bit per element with error feedback on every rank; strategy ddp (or one process)
    with grad_compression none; see docs/guides/strategies.md. lamb is LAMB with DeepSpeed FusedLamb's arithmetic
    (max_coeff, min_coeff, bias_correction, eps_inside_sqrt; any strategy: under zero2/fsdp the trust ratio's norms
    are reduced over the shards). onebit_lamb is 1-bit LAMB (Li et al. 2021, DeepSpeed's OnebitLamb: freeze_step,
    coeff_beta, factor_*) on 1-bit Adam's exchange, with 1-bit Adam's constraints."""
    factory: str | None = None
    """Import path of any optimizer: a torch.optim.Optimizer subclass (`torch.optim.Adadelta`) or a function
    (`mypkg.mod:make_opt`), called as factory(param_groups, lr=<optim.lr, scaled>, **kwargs) (plus
    weight_decay=optim.weight_decay on matrices when it is not 0); replaces name, momentum, betas and eps. zero1 needs
    an Optimizer subclass (ZeroRedundancyOptimizer builds one per rank)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `factory` (rho, betas, ...); lr and weight_decay come from optim.lr and
    optim.weight_decay."""
    scheduler_factory: str | None = None
    """Import path of an LR scheduler (`torch.optim.lr_scheduler.StepLR`, or a function), called as
    scheduler_factory(optimizer, **scheduler_kwargs); replaces dptrain's warmup and schedule (warmup_*, schedule,
    min_lr_ratio, schedule_convention are then not used). Its state is checkpointed."""
    scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `scheduler_factory` (step_size, gamma, ...)."""
    scheduler_interval: str = "step"
    """When `scheduler_factory`'s scheduler steps: step (after every optimizer step) or epoch (after the last step of
    each epoch of the global data order: every len(train set) // global_batch_size steps, at any world size)."""
    lr: float = 3e-3
    """Learning rate at `base_batch_size` (scaled by `lr_scaling` to the global batch)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW) or L2 (SGD); not applied to biases and norm weights."""
    momentum: float = 0.0
    """SGD momentum."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    lr_scaling: str = "none"
    """How the lr follows the global batch: none, linear (lr * G / base) or sqrt (lr * sqrt(G / base))."""
    base_batch_size: int | None = None
    """The global batch size `lr` was tuned for (default: the global batch, i.e. no scaling)."""
    warmup_steps: int = 20
    """Warmup steps from warmup_start_ratio * lr to the peak learning rate."""
    warmup_type: str = "linear"
    """Warmup curve: linear or log (DeepSpeed's default: log(step + 1) / log(warmup_steps))."""
    warmup_start_ratio: float = 0.0
    """Learning rate at the start of warmup as a fraction of the peak (DeepSpeed: warmup_min_lr / warmup_max_lr or
    warmup_min_ratio)."""
    schedule: str = "cosine"
    """After warmup: cosine (to min_lr_ratio * lr), linear (likewise) or constant; or DeepSpeed's onecycle or
    lr_range_test (OneCycle, LRRangeTest: their own parameters in schedule_params, warmup unused)."""
    schedule_params: dict[str, Any] = field(default_factory=dict)
    """onecycle / lr_range_test only: DeepSpeed's parameters under DeepSpeed's names (cycle_min_lr, cycle_max_lr,
    cycle_first_step_size, ...; lr_range_test_min_lr, lr_range_test_step_size, ...), absolute learning rates;
    what a DeepSpeed file's OneCycle or LRRangeTest scheduler block becomes."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak for the cosine and linear schedules."""
    schedule_convention: str = "dptrain"
    """dptrain: step s trains at the schedule's value for s, linear warmup reaches the peak at step warmup_steps - 1;
    deepspeed: DeepSpeed's WarmupLR/WarmupDecayLR/WarmupCosineLR formulas exactly (its scheduler steps after the
    optimizer, so step s trains at its iteration s - 1; warmup at least 2 steps)."""
    freeze_step: int = 100
    """onebit_adam, onebit_lamb: optimizer steps of full AdamW (onebit_lamb: LAMB; gradients all-reduced) before the
    variance freezes and the momentum is compressed (1-bit Adam's warm-up: past the learning-rate warm-up, once the
    variance has settled; measured in docs/results/communication.md, "1-bit Adam")."""
    max_coeff: float = 10.0
    """lamb, onebit_lamb: upper bound of LAMB's trust ratio ||w|| / ||update|| per parameter tensor (DeepSpeed's)."""
    min_coeff: float = 0.01
    """lamb, onebit_lamb: lower bound of LAMB's trust ratio (DeepSpeed's)."""
    bias_correction: bool = True
    """lamb: step size lr * sqrt(1 - beta2^t) / (1 - beta1^t) (DeepSpeed FusedLamb's bias correction); false: lr."""
    eps_inside_sqrt: bool = False
    """lamb: denominator sqrt(v + eps) instead of sqrt(v) + eps (DeepSpeed's eps_inside_sqrt; its OnebitLamb takes the
    key and does not use it, nor does onebit_lamb)."""
    coeff_beta: float = 0.9
    """onebit_lamb: EMA coefficient of the trust ratio during the warm-up; the average is frozen with the variance."""
    factor_max: float = 4.0
    """onebit_lamb: upper bound of the scaling factor applied to the frozen trust ratio after the warm-up."""
    factor_min: float = 0.5
    """onebit_lamb: lower bound of that scaling factor."""
    factor_threshold: float = 0.1
    """onebit_lamb: how far the scaling factor may move from one step to the next (a fraction of the last)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm (over all shards) to this value; null disables clipping."""


@dataclass(frozen=True)
class PrecisionConfig:
    dtype: str = "fp32"
    """fp32, bf16 (autocast) or fp16 (autocast with dynamic loss scaling)."""
    init_scale: float = 2.0**16
    """fp16: initial loss scale."""
    growth_interval: int = 2000
    """fp16: steps without overflow before the loss scale doubles (loss_scaler=deepspeed: DeepSpeed's
    loss_scale_window; it doubles after window + 1 clean steps since the last overflow, then every window)."""
    loss_scaler: str = "torch"
    """fp16: torch (torch.amp.GradScaler: halves on every overflow, no floor) or deepspeed (DeepSpeed's
    DynamicLossScaler: hysteresis, min_loss_scale, static_loss_scale); DeepSpeed files get deepspeed."""
    hysteresis: int = 2
    """fp16, loss_scaler=deepspeed: overflows absorbed before the scale halves (DeepSpeed's hysteresis)."""
    consecutive_hysteresis: bool = False
    """fp16, loss_scaler=deepspeed: a clean step refills the hysteresis (DeepSpeed's consecutive_hysteresis)."""
    min_loss_scale: float = 1.0
    """fp16, loss_scaler=deepspeed: the scale never falls below this (DeepSpeed's min_loss_scale)."""
    static_loss_scale: float = 0.0
    """fp16, loss_scaler=deepspeed: a fixed loss scale (DeepSpeed's loss_scale); 0: dynamic scaling. Steps with
    overflowing gradients are skipped either way."""


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (for `config show` and docs/reference/config.md),
    with its lines joined: a docstring may wrap over several source lines."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[union-attr]
    return docs


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict (tuples as lists) suitable for YAML/JSON."""
    d = dataclasses.asdict(cfg)

    def fix(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, tuple | list):
            return [fix(v) for v in x]
        return x

    return fix(d)


def default_out_dir(cfg: Config) -> str:
    """runs/<recipe>-<timestamp> unless log.out_dir is set."""
    import time

    if cfg.log.out_dir:
        return cfg.log.out_dir
    return os.path.join("runs", f"{cfg.log.name}-{time.strftime('%Y%m%d-%H%M%S')}")
