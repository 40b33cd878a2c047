"""DeepSpeed's optimizer block -> optim.* (DeepSpeed's engine: `_configure_basic_optimizer`)."""

from __future__ import annotations

from typing import Any

from dptrain.config.deepspeed.mapping import DeepSpeedMapping, bad, number
from dptrain.config.fields import ConfigError

REFUSED_OPTIM = {
    "zerooneadam": 'use "Adam" now; 1-bit gradient compression (parallel.grad_compression=onebit) is planned '
    "(issue 11)",
    "onebitlamb": 'use "AdamW"; dptrain has no LAMB (see "Lamb" below) and DeepSpeed 0.19 itself no longer has 1-bit '
    "LAMB (its engine builds no optimizer of that name)",
    "lamb": 'use "AdamW" (dptrain has no LAMB: DeepSpeed\'s FusedLamb is a CUDA kernel with no CPU build, so there is '
    "no reference to hold an implementation to); for large-batch training add optim.lr_scaling=sqrt",
}


def optimizer(opt: dict[str, Any] | None, m: DeepSpeedMapping) -> None:
    if opt is None:
        return
    kind = str(opt.get("type", ""))
    low = kind.lower()
    if low in REFUSED_OPTIM:
        raise ConfigError(f"DeepSpeed optimizer.type={kind!r} is not supported; {REFUSED_OPTIM[low]}")
    low = "adam" if low == "deepspeed_adam" else low  # old name of DeepSpeedCPUAdam (adamw_mode=True)
    if low not in ("sgd", "adam", "adamw", "onebitadam"):
        raise bad("optimizer.type", opt.get("type"), "use one of: SGD, Adam, AdamW, OneBitAdam")
    params = opt.get("params", {})
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise bad("optimizer.params", params, "it must be a mapping (a JSON object)")
    params = {k: v for k, v in params.items() if v != "auto"}
    if "max_grad_norm" in params:  # DeepSpeed 0.19's engine refuses it at initialize; older FusedAdam took it
        m.notes.append(
            f"optimizer.params.max_grad_norm={params.pop('max_grad_norm')!r} is not used (DeepSpeed 0.19 refuses it "
            "at deepspeed.initialize): the top-level gradient_clipping clips"
        )
    adam_w = params.pop("adam_w_mode", True)
    torch_adam = params.pop("torch_adam", False)
    if not isinstance(adam_w, bool):
        raise bad("optimizer.params.adam_w_mode", adam_w, "use true or false")
    if not isinstance(torch_adam, bool):
        raise bad("optimizer.params.torch_adam", torch_adam, "use true or false")
    # DeepSpeed: "Adam" is AdamW (decoupled decay) unless adam_w_mode is false; "AdamW" is always AdamW
    name = "sgd" if low == "sgd" else ("adam" if low == "adam" and not adam_w else "adamw")
    name = "onebit_adam" if low == "onebitadam" else name  # cuda_aware, comm_backend_name: ignored (torch.distributed)
    m.put("optimizer.type", "optim.name", name)
    # FusedAdam / DeepSpeedCPUAdam / torch.optim.SGD default weight_decay 0; with torch_adam DeepSpeed builds
    # torch.optim.AdamW (decoupled) or torch.optim.Adam and takes torch's own default: AdamW's is 0.01
    decay = 0.01 if torch_adam and name == "adamw" else 0.0
    defaults: dict[str, Any] = {"lr": 1e-3, "weight_decay": decay}
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
                    raise bad(key, v, "it must be a list of two numbers, e.g. [0.9, 0.999]")
                v = [number(key, b) for b in v]
            else:
                number(key, v, positive=pk == "lr")
            m.put(key, f"optim.{pk}", v)
        elif pk not in (opt.get("params") or {}):  # "auto" keeps dptrain's value
            m.default(key + (" (torch.optim.AdamW's, torch_adam)" if decay else ""), f"optim.{pk}", dflt)
    m.ignored += [f"optimizer.params.{k}" for k in params]
    m.ignored += [f"optimizer.{k}" for k in opt if k not in ("type", "params")]
