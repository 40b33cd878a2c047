"""DeepSpeed's optimizer block -> optim.* (DeepSpeed's engine: `_configure_basic_optimizer`)."""

from __future__ import annotations

from typing import Any

from dptrain.config.deepspeed.mapping import DeepSpeedMapping, bad, number
from dptrain.config.fields import ConfigError

REFUSED_OPTIM = {
    "zerooneadam": 'use "Adam" now; 1-bit gradient compression (parallel.grad_compression=onebit) is planned '
    "(issue 11)",
}
NAMES = {"sgd": "sgd", "adam": "adam", "adamw": "adamw", "onebitadam": "onebit_adam", "lamb": "lamb",
         "onebitlamb": "onebit_lamb"}
LAMB_DEFAULTS: dict[str, Any] = {"max_coeff": 10.0, "min_coeff": 0.01, "eps_inside_sqrt": False}
"""FusedLamb's and OnebitLamb's own defaults (deepspeed/ops/lamb/fused_lamb.py, runtime/fp16/onebit/lamb.py)."""
ONEBIT_LAMB_DEFAULTS: dict[str, Any] = {"freeze_step": 100000, "coeff_beta": 0.9, "factor_max": 4.0,
                                        "factor_min": 0.5, "factor_threshold": 0.1}


def optimizer(opt: dict[str, Any] | None, m: DeepSpeedMapping) -> None:
    if opt is None:
        return
    kind = str(opt.get("type", ""))
    low = kind.lower()
    if low in REFUSED_OPTIM:
        raise ConfigError(f"DeepSpeed optimizer.type={kind!r} is not supported; {REFUSED_OPTIM[low]}")
    low = "adam" if low == "deepspeed_adam" else low  # old name of DeepSpeedCPUAdam (adamw_mode=True)
    if low not in NAMES:
        raise bad("optimizer.type", opt.get("type"), "use one of: SGD, Adam, AdamW, OneBitAdam, Lamb, OneBitLamb")
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
    lamb = low == "lamb"  # FusedLamb takes neither: left in params, refused below
    adam_w = True if lamb else params.pop("adam_w_mode", True)
    torch_adam = False if lamb else params.pop("torch_adam", False)
    if not isinstance(adam_w, bool):
        raise bad("optimizer.params.adam_w_mode", adam_w, "use true or false")
    if not isinstance(torch_adam, bool):
        raise bad("optimizer.params.torch_adam", torch_adam, "use true or false")
    # DeepSpeed: "Adam" is AdamW (decoupled decay) unless adam_w_mode is false; "AdamW" is always AdamW
    name = "sgd" if low == "sgd" else ("adam" if low == "adam" and not adam_w else "adamw")
    if low in ("onebitadam", "lamb", "onebitlamb"):
        name = NAMES[low]  # cuda_aware, comm_backend_name: ignored (torch.distributed collectives)
    if name in ("lamb", "onebit_lamb") and params.pop("amsgrad", False) is not False:
        raise bad("optimizer.params.amsgrad", True, "DeepSpeed's LAMB optimizers refuse AMSGrad: remove it")
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
    if name == "lamb":
        defaults.update(LAMB_DEFAULTS, bias_correction=True)
    if name == "onebit_lamb":
        defaults.update(LAMB_DEFAULTS, **ONEBIT_LAMB_DEFAULTS)
        m.notes.append("OneBitLamb: dptrain updates from step 1; DeepSpeed's first step only initialises "
                       "(train/onebit_lamb.py)")
    for pk, dflt in defaults.items():
        key = f"optimizer.params.{pk}"
        if pk in params:
            v = params.pop(pk)
            if pk == "betas":
                if not (isinstance(v, list | tuple) and len(v) == 2):
                    raise bad(key, v, "it must be a list of two numbers, e.g. [0.9, 0.999]")
                v = [number(key, b) for b in v]
            elif isinstance(dflt, bool):
                if not isinstance(v, bool):
                    raise bad(key, v, "use true or false")
            else:
                number(key, v, positive=pk == "lr", integer=pk == "freeze_step")
            m.put(key, f"optim.{pk}", v)
        elif pk not in (opt.get("params") or {}):  # "auto" keeps dptrain's value
            m.default(key + (" (torch.optim.AdamW's, torch_adam)" if decay else ""), f"optim.{pk}", dflt)
    if name == "lamb" and params:  # DeepSpeed's engine builds FusedLamb(**params): an unknown one is a TypeError
        raise bad(f"optimizer.params.{next(iter(params))}", params[next(iter(params))],
                  f"FusedLamb takes {', '.join(defaults)}; remove it")
    m.ignored += [f"optimizer.params.{k}" for k in params]
    m.ignored += [f"optimizer.{k}" for k in opt if k not in ("type", "params")]
