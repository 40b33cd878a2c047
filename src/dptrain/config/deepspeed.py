"""DeepSpeed-style JSON: translate a DeepSpeed config dict into dptrain's nested config dict.

A DeepSpeed file means what it means in DeepSpeed: every key the file leaves out takes DeepSpeed's
default (not dptrain's), and the translation is recorded key by key (`DeepSpeedMapping`) so that
`dptrain config show` can list what each key became, the defaults applied and the keys ignored.
"auto" values (Hugging Face Trainer style) keep dptrain's own value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dptrain.config.fields import Config, ConfigError
from dptrain.config.load import set_dotted

_ZERO_STAGE = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}
_SCHEDULES = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
_REFUSED_OPTIM = {
    "zerooneadam": 'use "Adam" now; 1-bit gradient compression (parallel.grad_compression=onebit) is planned '
    "(issue 11)",
    "onebitlamb": 'use "AdamW"; dptrain has no LAMB and no 1-bit compression yet (issue 11)',
    "lamb": 'use "AdamW" (dptrain has no LAMB); for large-batch training add optim.lr_scaling=sqrt',
}


@dataclass
class DeepSpeedMapping:
    """What a DeepSpeed file became: (ds key, dptrain field, value) rows, DeepSpeed defaults applied,
    keys ignored (with the reason), and notes worth a warning (lenient reads, semantic differences)."""

    config: dict[str, Any] = field(default_factory=dict)
    mapped: list[tuple[str, str, Any]] = field(default_factory=list)
    defaults: list[tuple[str, str, Any]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def put(self, ds_key: str, target: str, value: Any) -> None:
        set_dotted(self.config, target, value)
        self.mapped.append((ds_key, target, value))

    def default(self, ds_key: str, target: str, value: Any) -> None:
        set_dotted(self.config, target, value)
        self.defaults.append((ds_key, target, value))

    def report(self) -> str:
        """The `config show` section: one line per key."""
        lines = ["# DeepSpeed keys -> dptrain fields:"]
        lines += [f"#   {k} -> {t} = {v!r}" for k, t, v in self.mapped]
        lines += ["# DeepSpeed defaults applied (keys the file leaves out):"]
        lines += [f"#   {k} (DeepSpeed default) -> {t} = {v!r}" for k, t, v in self.defaults] or ["#   (none)"]
        lines += ["# ignored (not used by dptrain):"] + ([f"#   {u}" for u in self.ignored] or ["#   (none)"])
        lines += [f"# note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def _bad(key: str, value: Any, valid: str) -> ConfigError:
    return ConfigError(f"DeepSpeed {key}={value!r} is not valid; {valid}")


def _block(ds: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The mapping under `key` (None when absent), with "auto" values dropped; refuses a non-mapping."""
    if key not in ds or ds[key] is None:
        return None
    v = ds[key]
    if not isinstance(v, dict):
        raise _bad(key, v, "it must be a mapping (a JSON object)")
    return {k: x for k, x in v.items() if x != "auto"}


def _number(key: str, v: Any, *, integer: bool = False, positive: bool = False) -> Any:
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    if not ok or isinstance(v, bool) or (positive and v <= 0):
        kind = "an integer" if integer else "a number"
        raise _bad(key, v, f'it must be {kind}{" > 0" if positive else ""} (or "auto")')
    return v


def _enabled(key: str, v: Any, m: DeepSpeedMapping) -> bool:
    """DeepSpeed's `enabled` flag. Strings "true"/"false" and 0/1 are read (pydantic does) with a note."""
    if isinstance(v, bool):
        return v
    lenient = {"true": True, "false": False, 1: True, 0: False}
    if isinstance(v, str | int) and v in lenient:
        m.notes.append(f"{key}={v!r} read as {lenient[v]} (write true or false)")
        return lenient[v]
    raise _bad(key, v, "use true or false")


def translate_deepspeed(ds: dict[str, Any]) -> DeepSpeedMapping:
    """Translate a DeepSpeed config dict into a DeepSpeedMapping (its `.config` is the dptrain dict)."""
    m = DeepSpeedMapping()
    ds = dict(ds)
    _batch(ds, m)
    if "gradient_clipping" not in ds:  # DeepSpeed's default is 0: no clipping
        m.default("gradient_clipping", "optim.grad_clip", None)
    for ds_key, target in (
        ("gradient_clipping", "optim.grad_clip"),
        ("seed", "train.seed"),
        ("steps_per_print", "train.log_every_steps"),
    ):
        v = ds.pop(ds_key, "auto")
        if v != "auto":
            v = _number(ds_key, v, integer=ds_key != "gradient_clipping")
            m.put(ds_key, target, None if ds_key == "gradient_clipping" and v == 0 else v)
    _optimizer(_block(ds, "optimizer"), m)
    ds.pop("optimizer", None)
    _scheduler(_block(ds, "scheduler"), m)
    ds.pop("scheduler", None)
    _precision(ds, m)
    _zero(ds.pop("zero_optimization", None), m)
    _pipeline(_block(ds, "pipeline"), m)
    ds.pop("pipeline", None)
    _tensor_parallel(_block(ds, "tensor_parallel"), m)
    ds.pop("tensor_parallel", None)
    native = ds.pop("dptrain", None) or {}  # native sections may ride along inside a DeepSpeed file
    if not isinstance(native, dict) or not all(isinstance(v, dict | None) for v in native.values()):
        raise _bad("dptrain", native, 'it must map section names to mappings, e.g. {"train": {"max_steps": 100}}')
    for section, values in native.items():
        for k, v in (values or {}).items():
            m.put(f"dptrain.{section}.{k}", f"{section}.{k}", v)
    m.ignored += list(ds)
    return m


def from_deepspeed(ds: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Translate a DeepSpeed config dict; return (nested dptrain dict, keys not used)."""
    m = translate_deepspeed(ds)
    return m.config, m.ignored


def _batch(ds: dict[str, Any], m: DeepSpeedMapping) -> None:
    """Batch keys as given; the rest is derived at resolve time by DeepSpeed's rules (resolve_batch)."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    if not any(k in ds for k in keys):
        m.notes.append(
            "no batch size given (DeepSpeed needs train_batch_size or train_micro_batch_size_per_gpu); "
            "dptrain uses global 32, micro 8 unless train.* overrides say otherwise"
        )
    given = {}
    for ds_key, target in (
        ("train_batch_size", "train.global_batch_size"),
        ("train_micro_batch_size_per_gpu", "train.micro_batch_size"),
        ("gradient_accumulation_steps", "train.grad_accum_steps"),
    ):
        v = ds.pop(ds_key, "auto")
        if v != "auto":
            given[ds_key] = _number(ds_key, v, integer=True, positive=True)
            m.put(ds_key, target, v)
    if "gradient_accumulation_steps" in given and len(given) == 1:
        m.notes.append(
            "gradient_accumulation_steps alone: DeepSpeed needs train_batch_size or "
            "train_micro_batch_size_per_gpu as well; dptrain uses micro batch 1"
        )


def _optimizer(opt: dict[str, Any] | None, m: DeepSpeedMapping) -> None:
    if opt is None:
        return
    kind = str(opt.get("type", ""))
    low = kind.lower()
    if low in _REFUSED_OPTIM:
        raise ConfigError(f"DeepSpeed optimizer.type={kind!r} is not supported; {_REFUSED_OPTIM[low]}")
    low = "adam" if low == "deepspeed_adam" else low  # old name of DeepSpeedCPUAdam (adamw_mode=True)
    if low not in ("sgd", "adam", "adamw", "onebitadam"):
        raise _bad("optimizer.type", opt.get("type"), "use one of: SGD, Adam, AdamW, OneBitAdam")
    params = opt.get("params", {})
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise _bad("optimizer.params", params, "it must be a mapping (a JSON object)")
    params = {k: v for k, v in params.items() if v != "auto"}
    adam_w = params.pop("adam_w_mode", True)
    if "torch_adam" in params:  # same math as FusedAdam: dptrain always runs torch's Adam/AdamW
        m.ignored.append(f"optimizer.params.torch_adam={params.pop('torch_adam')!r} (dptrain always uses torch.optim)")
    if not isinstance(adam_w, bool):
        raise _bad("optimizer.params.adam_w_mode", adam_w, "use true or false")
    # DeepSpeed: "Adam" is AdamW (decoupled decay) unless adam_w_mode is false; "AdamW" is always AdamW
    name = "sgd" if low == "sgd" else ("adam" if low == "adam" and not adam_w else "adamw")
    name = "onebit_adam" if low == "onebitadam" else name  # cuda_aware, comm_backend_name: ignored (torch.distributed)
    m.put("optimizer.type", "optim.name", name)
    defaults: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.0}
    if name == "sgd":
        defaults["momentum"] = 0.0
    else:
        defaults.update(betas=[0.9, 0.999], eps=1e-8)
    if name == "onebit_adam":
        defaults["freeze_step"] = 100000
        m.notes.append("OneBitAdam: dptrain's warm-up is AdamW with bias correction from step 1; DeepSpeed's first "
                       "step only initialises and it never bias-corrects (train/onebit_adam.py)")
    for pk, dflt in defaults.items():
        key = f"optimizer.params.{pk}"
        if pk in params:
            v = params.pop(pk)
            if pk == "betas":
                if not (isinstance(v, list | tuple) and len(v) == 2):
                    raise _bad(key, v, "it must be a list of two numbers, e.g. [0.9, 0.999]")
                v = [_number(key, b) for b in v]
            else:
                _number(key, v, positive=pk == "lr")
            m.put(key, f"optim.{pk}", v)
        elif pk not in (opt.get("params") or {}):  # "auto" keeps dptrain's value
            m.default(key, f"optim.{pk}", dflt)
    m.ignored += [f"optimizer.params.{k}" for k in params]
    m.ignored += [f"optimizer.{k}" for k in opt if k not in ("type", "params")]


def _scheduler(sch: dict[str, Any] | None, m: DeepSpeedMapping) -> None:
    if sch is None:  # DeepSpeed without a scheduler block: the optimizer's lr, constant
        m.default("scheduler", "optim.schedule", "constant")
        m.default("scheduler", "optim.warmup_steps", 0)
        return
    kind = sch.get("type")
    if not isinstance(kind, str) or kind not in _SCHEDULES:
        raise _bad(
            "scheduler.type",
            kind,
            "use WarmupLR, WarmupDecayLR or WarmupCosineLR "
            "(for OneCycle or LRRangeTest use optim.schedule=cosine|linear|constant with optim.warmup_steps)",
        )
    raw = sch.get("params", {})
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise _bad("scheduler.params", raw, "it must be a mapping (a JSON object)")
    params = {k: v for k, v in raw.items() if v != "auto"}
    m.put("scheduler.type", "optim.schedule", _SCHEDULES[kind])
    m.put("scheduler.type", "optim.schedule_convention", "deepspeed")

    def take(pk: str, dflt: Any) -> Any:
        if pk in params:
            return params.pop(pk)
        return None if pk in raw else dflt  # None: "auto"

    steps = take("warmup_num_steps", 1000)
    if steps is not None:
        (m.put if "warmup_num_steps" in raw else m.default)(
            "scheduler.params.warmup_num_steps",
            "optim.warmup_steps",
            _number("scheduler.params.warmup_num_steps", steps, integer=True),
        )
    wtype = take("warmup_type", "log")
    if wtype is not None:
        if wtype not in ("log", "linear"):
            raise _bad("scheduler.params.warmup_type", wtype, "use log or linear")
        (m.put if "warmup_type" in raw else m.default)("scheduler.params.warmup_type", "optim.warmup_type", wtype)
    total = take("total_num_steps", None)
    if total is not None:
        m.put(
            "scheduler.params.total_num_steps",
            "train.max_steps",
            _number("scheduler.params.total_num_steps", total, integer=True, positive=True),
        )
    if kind == "WarmupCosineLR":
        _cosine_ratios(take, raw, m)
    else:
        _min_max_lr(kind, take, raw, m)
    m.ignored += [f"scheduler.params.{k}" for k in params]


def _cosine_ratios(take: Any, raw: dict[str, Any], m: DeepSpeedMapping) -> None:
    for pk, target, dflt in (
        ("warmup_min_ratio", "optim.warmup_start_ratio", 0.0),
        ("cos_min_ratio", "optim.min_lr_ratio", 1e-4),
    ):
        v = take(pk, dflt)
        if v is not None:
            key = f"scheduler.params.{pk}"
            (m.put if pk in raw else m.default)(key, target, _number(key, v))


def _min_max_lr(kind: str, take: Any, raw: dict[str, Any], m: DeepSpeedMapping) -> None:
    """WarmupLR/WarmupDecayLR: absolute warmup_min_lr/warmup_max_lr become the peak lr and ratios of it.
    warmup_max_lr defaults to the optimizer's lr for WarmupLR and to 0.001 for WarmupDecayLR."""
    max_lr = take("warmup_max_lr", None if kind == "WarmupLR" else 1e-3)
    min_lr = take("warmup_min_lr", 0.0)
    if max_lr is not None:
        _number("scheduler.params.warmup_max_lr", max_lr, positive=True)
        (m.put if "warmup_max_lr" in raw else m.default)("scheduler.params.warmup_max_lr", "optim.lr", max_lr)
    if min_lr is None:
        return
    _number("scheduler.params.warmup_min_lr", min_lr)
    peak = max_lr if max_lr is not None else m.config.get("optim", {}).get("lr")
    if min_lr and peak is None:
        m.ignored.append('scheduler.params.warmup_min_lr (the peak lr is "auto"; set optim.warmup_start_ratio)')
        return
    ratio = min_lr / peak if min_lr else 0.0
    if not 0.0 <= ratio <= 1.0:
        raise _bad("scheduler.params.warmup_min_lr", min_lr, f"it must lie between 0 and the peak lr {peak!r}")
    put = m.put if "warmup_min_lr" in raw else m.default
    put("scheduler.params.warmup_min_lr", "optim.warmup_start_ratio", ratio)
    if kind == "WarmupDecayLR":  # decays to warmup_min_lr
        put("scheduler.params.warmup_min_lr", "optim.min_lr_ratio", ratio)


def _precision(ds: dict[str, Any], m: DeepSpeedMapping) -> None:
    ds_raw = {k: v for k, v in ds.items() if isinstance(v, dict)}
    blocks = {}
    for key, alias in (("fp16", None), ("bf16", "bfloat16")):
        for name in (key, alias):
            if name and name in ds:
                b = _block(ds, name)
                ds.pop(name)
                if key in blocks and b is not None:
                    raise ConfigError(f"DeepSpeed config has both {key} and {name}; keep one")
                blocks[key] = (name, b or {})
    on = {k: _enabled(f"{name}.enabled", b["enabled"], m) for k, (name, b) in blocks.items() if "enabled" in b}
    if on.get("fp16") and on.get("bf16"):
        raise ConfigError("DeepSpeed config enables both fp16 and bf16; enable at most one")
    for key, (name, b) in blocks.items():
        extra = [k for k in b if k != "enabled"]
        if not on.get(key):
            if extra and (ds_raw.get(name) or {}).get("enabled") != "auto":  # "auto": the HF Trainer decides
                m.ignored.append(f"{name}.{{{', '.join(extra)}}} ({name} is not enabled)")
            continue
        m.put(f"{name}.enabled", "precision.dtype", key)
        if key == "bf16":
            m.ignored += [f"{name}.{k}" for k in extra]
            continue
        _fp16_scaler(b, m)


def _fp16_scaler(b: dict[str, Any], m: DeepSpeedMapping) -> None:
    b = dict(b)
    b.pop("enabled", None)
    power = b.pop("initial_scale_power", None)
    if power is None:
        m.default("fp16.initial_scale_power", "precision.init_scale", 2.0**16)
    else:
        m.put(
            "fp16.initial_scale_power",
            "precision.init_scale",
            float(2 ** _scale_power(power)),
        )
    window = b.pop("loss_scale_window", None)
    if window is None:
        m.default("fp16.loss_scale_window", "precision.growth_interval", 1000)
    else:
        m.put(
            "fp16.loss_scale_window",
            "precision.growth_interval",
            _number("fp16.loss_scale_window", window, integer=True, positive=True),
        )
    if b.pop("loss_scale", 0) != 0:
        m.ignored.append("fp16.loss_scale (static loss scale; dptrain uses dynamic scaling)")
    for k, why in (
        ("hysteresis", "torch's GradScaler halves the scale on every overflow"),
        ("min_loss_scale", "torch's GradScaler has no floor"),
    ):
        if k in b:
            m.ignored.append(f"fp16.{k}={b.pop(k)!r} ({why})")
    m.ignored += [f"fp16.{k}" for k in b]


def _scale_power(power: Any) -> int:
    """fp16.initial_scale_power: the loss scale starts at 2**power; above 64 it is beyond any gradient's range."""
    power = _number("fp16.initial_scale_power", power, integer=True)
    if not 0 <= power <= 64:
        raise _bad("fp16.initial_scale_power", power, "use an integer from 0 to 64 (the scale starts at 2**power)")
    return int(power)


def _zero(zero: Any, m: DeepSpeedMapping) -> None:
    if zero is None or zero == "auto":
        return
    if isinstance(zero, bool):  # legacy form: true is stage 1, as DeepSpeed reads it
        m.put("zero_optimization", "parallel.strategy", "zero1" if zero else "ddp")
        return
    if not isinstance(zero, dict):
        raise _bad("zero_optimization", zero, 'use a mapping such as {"stage": 2}, or true/false')
    zero = {k: v for k, v in zero.items() if v != "auto"}
    stage = zero.pop("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in _ZERO_STAGE:
        raise _bad("zero_optimization.stage", stage, "use 0, 1, 2 or 3")
    m.put("zero_optimization.stage", "parallel.strategy", _ZERO_STAGE[stage])
    offload = []
    legacy = zero.pop("cpu_offload", False)  # DeepSpeed < 0.3.16: "cpu_offload": true == offload_optimizer to cpu
    if legacy is True:
        zero.setdefault("offload_optimizer", {"device": "cpu"})
    elif legacy is not False:
        raise _bad("zero_optimization.cpu_offload", legacy, "use true or false")
    for k in ("offload_optimizer", "offload_param"):
        sub = zero.pop(k, None) or {}
        if not isinstance(sub, dict):
            raise _bad(f"zero_optimization.{k}", sub, 'it must be a mapping such as {"device": "cpu"}')
        device = sub.get("device", "none")
        if device not in ("none", "cpu", None):
            raise _bad(
                f"zero_optimization.{k}.device",
                device,
                "dptrain offloads to the CPU only (device: cpu); NVMe offload has no PyTorch equivalent",
            )
        if device == "cpu":
            offload.append(k)
        m.ignored += [f"zero_optimization.{k}.{sk}" for sk in sub if sk != "device"]
    if offload and stage in (0, 1):
        raise ConfigError(
            f"DeepSpeed {' and '.join(offload)} with zero_optimization.stage={stage} is not supported: "
            "dptrain offloads through FSDP2's CPUOffloadPolicy, which shards; "
            "use stage 2 (zero2) or 3 (fsdp) with offload"
        )
    if offload:
        m.put(f"zero_optimization.{offload[0]}.device", "parallel.cpu_offload", True)
        if stage == 2:
            m.notes.append(
                "ZeRO-2 with CPU offload maps to zero2 + FSDP2 CPUOffloadPolicy: parameters, gradients and optimizer "
                "state are sharded on the CPU and the optimizer steps there, as in DeepSpeed; unlike DeepSpeed, the "
                "GPU keeps no parameter copy between steps (they are gathered from the host each step)"
            )
    if "reduce_bucket_size" in zero and stage == 0:
        size = _number("zero_optimization.reduce_bucket_size", zero.pop("reduce_bucket_size"), positive=True)
        m.put("zero_optimization.reduce_bucket_size", "parallel.bucket_cap_mb", size * 4 / 2**20)
    m.ignored += [f"zero_optimization.{k}" for k in zero]


def mapping_for_file(path: str) -> DeepSpeedMapping | None:
    """The mapping record of a DeepSpeed-style JSON file, or None for any other config file."""
    import dataclasses
    import json
    from pathlib import Path


    p = Path(path)
    if p.suffix != ".json" or not p.is_file():
        return None
    raw = json.loads(p.read_text())
    if not isinstance(raw, dict) or set(raw) <= {f.name for f in dataclasses.fields(Config)}:
        return None
    return translate_deepspeed(raw)


def _pipeline(pipe: dict[str, Any] | None, m: DeepSpeedMapping) -> None:
    """DeepSpeed's pipeline engine streams `gradient_accumulation_steps` micro-batches of
    `train_micro_batch_size_per_gpu` rows through the stages in ONE schedule per optimizer step.
    The same arithmetic in dptrain: `parallel.pp` = stages, one dptrain micro-step
    (`train.grad_accum_steps` = 1) whose micro-batch (micro x GAS rows) is split into
    `parallel.pp_microbatches` = GAS pipeline micro-batches, under the 1F1B schedule DeepSpeed's
    TrainSchedule follows. Global batch, per-GPU pipeline micro-batch and gradient are unchanged."""
    if pipe is None:
        return
    stages = pipe.pop("stages", None)
    if stages is None:
        m.ignored.append("pipeline (no 'stages': the model is trained without pipeline parallelism)")
        m.ignored += [f"pipeline.{k}" for k in pipe]
        return
    m.put("pipeline.stages", "parallel.pp", _number("pipeline.stages", stages, integer=True, positive=True))
    if stages == 1:
        return
    m.default("pipeline (DeepSpeed's TrainSchedule)", "parallel.pp_schedule", "1f1b")
    train = m.config.get("train", {})
    gas = train.get("grad_accum_steps") or 1
    micro = train.get("micro_batch_size")
    m.put("gradient_accumulation_steps", "parallel.pp_microbatches", gas)
    m.put("gradient_accumulation_steps (pipelined)", "train.grad_accum_steps", 1)
    if micro is not None:
        m.put("train_micro_batch_size_per_gpu x gradient_accumulation_steps", "train.micro_batch_size", micro * gas)
    if "micro_batch_size" in pipe:  # not a DeepSpeed key (guides write it): DeepSpeed's is the per-GPU micro-batch
        pmb = _number("pipeline.micro_batch_size", pipe.pop("micro_batch_size"), integer=True, positive=True)
        glob = train.get("global_batch_size")
        where = (
            f"; the two agree at data-parallel size {glob // (gas * pmb)}" if glob and glob % (gas * pmb) == 0 else ""
        )
        m.notes.append(
            f"pipeline.micro_batch_size={pmb} is not a DeepSpeed key and is not used: as in DeepSpeed, a pipeline "
            f"micro-batch is train_micro_batch_size_per_gpu rows (= train_batch_size / (gradient_accumulation_steps x "
            f"data-parallel size)), {gas} of them per schedule{where}; config show's pipeline line gives the size"
        )
    for k in ("partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned", "grad_partitioned"):
        if k in pipe:
            m.ignored.append(
                f"pipeline.{k}={pipe.pop(k)!r} (dptrain splits the built-in LLaMA by layer ranges: "
                "parallel.pp_layers; activation checkpointing: parallel.activation_checkpointing)"
            )
    m.ignored += [f"pipeline.{k}" for k in pipe]


def _tensor_parallel(tp: dict[str, Any] | None, m: DeepSpeedMapping) -> None:
    """DeepSpeed's AutoTP for training (`tensor_parallel.autotp_size`) -> `parallel.tp`: dptrain
    shards the built-in LLaMA with its own plan (or `parallel.tp_plan` for other models)."""
    if tp is None:
        return
    size = tp.pop("autotp_size", tp.pop("tp_size", None))
    if size is not None:
        m.put(
            "tensor_parallel.autotp_size",
            "parallel.tp",
            _number("tensor_parallel.autotp_size", size, integer=True, positive=True),
        )
    m.ignored += [f"tensor_parallel.{k}" for k in tp]
