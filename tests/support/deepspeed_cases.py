"""DeepSpeed's own unit-test cases, encoded as (name, config, data-parallel size) for the conformance suite.

Sources (deepspeedai/DeepSpeed, tests/unit/runtime/): test_ds_config_dict.py (TestBatchConfig: every subset of
the three batch keys for its four (batch, micro, gas) rows at world size 2; bf16/bfloat16), pipe/test_pipe.py
(TestPipeCifar10: train_batch_size 4 at pp2/dp2 and pp4/dp1; the stage count, set there by the PipelineModule,
is written as pipeline.stages), half_precision/test_dynamic_loss_scale.py and the fp16 validators
(test_precision_config_loss_scale.py), test_lr_schedulers.py (TestGetLrBeforeTrain, TestLrSchedule,
TestSchedulerOptimizerParity, TestLrRange, TestOneCycle), and runtime/config.py's own checks
(gradient_allreduce_op, removed blocks). The configs are re-encoded here, not copied.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

BASE_OPT = {"type": "Adam", "params": {"lr": 0.00015}}
KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _batch_cases() -> list[tuple[str, dict[str, Any], int]]:
    out = []
    for row in ((32, 16, 1), (32, 8, 2), (33, 17, 2), (32, 18, 1)):
        for n in (1, 2, 3):
            for keys in combinations(range(3), n):
                ds = {KEYS[i]: row[i] for i in keys}
                name = "batch " + "/".join(str(row[i]) if i in keys else "-" for i in range(3))
                out.append((name, {**ds, "optimizer": BASE_OPT}, 2))
    return out


def _schedule(kind: str, params: dict[str, Any], extra: str = "") -> tuple[str, dict[str, Any], int]:
    ds = {"train_batch_size": 2, "optimizer": BASE_OPT, "scheduler": {"type": kind, "params": params},
          "gradient_clipping": 1.0}
    return (f"{kind} {extra or params}", ds, 1)


def _lr_cases() -> list[tuple[str, dict[str, Any], int]]:
    out = [
        _schedule("WarmupLR", {}),
        _schedule("WarmupDecayLR", {"warmup_num_steps": 10, "total_num_steps": 20}),
        _schedule("WarmupCosineLR", {"warmup_num_steps": 10, "total_num_steps": 20}),
        _schedule("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1}),
        _schedule("LRRangeTest", {}),
        _schedule("WarmupDecayLR", {"warmup_num_steps": 5, "total_num_steps": 10}),
        _schedule("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_first_step_size": 5,
                               "decay_step_size": 5}),
        _schedule("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 1}),
        _schedule("WarmupLR", {"warmup_num_steps": None}, "warmup_num_steps null"),
        _schedule("WarmupLR", {"warmup_type": "cos"}, "unknown warmup_type"),
    ]
    for steps in (10, 15, 19, 33):
        for wtype in ("log", "linear"):
            p = {"warmup_min_lr": 0.1, "warmup_max_lr": 0.2, "warmup_num_steps": steps, "warmup_type": wtype}
            out.append(_schedule("WarmupLR", p))
            out.append(_schedule("WarmupDecayLR", {**p, "total_num_steps": 2 * steps}))
    for lo, rate, size, stair in ((1e-4, 1e-5, 1, True), (1e-5, 1e-5, 1, False), (1e-4, 1e-3, 10, True),
                                  (1e-3, 1e-3, 10, False), (1e-2, 1e-2, 19, True), (1e-2, 1e-2, 19, False)):
        out.append(_schedule("LRRangeTest", {"lr_range_test_min_lr": lo, "lr_range_test_step_rate": rate,
                                             "lr_range_test_step_size": size, "lr_range_test_staircase": stair}))
    for lo, hi, rate, size, decay in ((1e-5, 1e-2, 1e-3, 10, 10), (1e-3, 1e-1, 0, 21, 21),
                                      (1e-3, 1e-1, 1e-1, 21, 21), (1e-5, 1e-1, 0, 10, 0)):
        out.append(_schedule("OneCycle", {"cycle_min_lr": lo, "cycle_max_lr": hi, "decay_lr_rate": rate,
                                          "cycle_first_step_size": size, "decay_step_size": decay}))
    out.append(_schedule("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 7,
                                      "cycle_second_step_size": 5, "cycle_first_stair_count": 2,
                                      "decay_step_size": 3, "decay_lr_rate": 0.1}, "stairs, asymmetric"))
    return out


def _fp16(fp16: dict[str, Any], name: str) -> tuple[str, dict[str, Any], int]:
    return (f"fp16 {name}", {"train_batch_size": 1, "optimizer": BASE_OPT, "fp16": {"enabled": True, **fp16}}, 1)


def _fp16_cases() -> list[tuple[str, dict[str, Any], int]]:
    return [
        _fp16({"loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2}, "test_no_overflow"),
        _fp16({"loss_scale": 0, "initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1},
              "test_all_overflow"),
        _fp16({"loss_scale": 0, "initial_scale_power": 4, "loss_scale_window": 2, "min_loss_scale": 2.0,
               "hysteresis": 1}, "test_all_overflow min 2"),
        _fp16({"initial_scale_power": 8, "hysteresis": 3}, "hysteresis 3"),
        _fp16({"initial_scale_power": 8, "hysteresis": 2, "consecutive_hysteresis": True}, "consecutive"),
        _fp16({}, "defaults"),
        _fp16({"loss_scale": 128}, "static 128"),
        _fp16({"loss_scale": 128, "loss_scale_window": 0, "min_loss_scale": 0}, "static, unused checks skipped"),
        _fp16({"loss_scale": -1}, "loss_scale negative"),
        _fp16({"loss_scale": True}, "loss_scale bool"),
        _fp16({"loss_scale": "inf"}, "loss_scale inf"),
        _fp16({"loss_scale_window": 0}, "window 0"),
        _fp16({"min_loss_scale": 0}, "min 0"),
        _fp16({"loss_scale_window": True}, "window bool"),
        _fp16({"min_loss_scale": float("nan")}, "min nan"),
        _fp16({"initial_scale_power": 32}, "power 32"),
    ]


def _other_cases() -> list[tuple[str, dict[str, Any], int]]:
    base = {"train_batch_size": 8, "optimizer": BASE_OPT}
    return [
        ("pipe cifar10 pp2/dp2", {"train_batch_size": 4, "optimizer": BASE_OPT, "pipeline": {"stages": 2}}, 2),
        ("pipe cifar10 pp4/dp1", {"train_batch_size": 4, "optimizer": BASE_OPT, "pipeline": {"stages": 4}}, 1),
        ("bf16", {**base, "bf16": {"enabled": True}}, 2),
        ("bfloat16", {**base, "bfloat16": {"enabled": True}}, 2),
        ("allreduce mean", {**base, "gradient_allreduce_op": "mean"}, 2),
        ("allreduce MEAN", {**base, "gradient_allreduce_op": "MEAN"}, 2),
        ("allreduce max", {**base, "gradient_allreduce_op": "max"}, 2),
        ("elasticity", {**base, "elasticity": {"enabled": True, "max_train_batch_size": 64}}, 2),
        ("sparse_attention", {**base, "sparse_attention": {"mode": "fixed"}}, 2),
        ("no clipping key", dict(base), 2),
        ("clipping 0", {**base, "gradient_clipping": 0.0}, 2),
        ("torch_adam decoupled", {**base, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}},
         2),
        ("torch_adam coupled", {**base, "optimizer": {"type": "Adam", "params": {
            "lr": 1e-3, "torch_adam": True, "adam_w_mode": False}}}, 2),
        ("AdamW adam_w_mode false", {**base, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, 2),
        ("SGD", {**base, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}, 2),
    ]


def deepspeed_unit_cases() -> list[tuple[str, dict[str, Any], int]]:
    return _batch_cases() + _lr_cases() + _fp16_cases() + _other_cases()
