"""Real public DeepSpeed configs (trimmed to the keys that matter), each with its source and what it means at a
data-parallel size of 2 (or the refusal's pattern): used by tests/test_deepspeed_configs.py and, as configs DeepSpeed
itself reads, by tests/test_deepspeed_conformance.py and benchmarks/acceptance/deepspeed_conformance.py."""

from __future__ import annotations

from typing import Any

_FP16_MEGATRON = {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
_HF_AUTO_OPT = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
_HF_AUTO_SCHED = {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}
_HF_AUTO_BATCH = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}

# (source, trimmed config, expected at dp 2 or the refusal's pattern)
# expected keys: strategy, batch (global, micro, accum), optim (name, lr, weight_decay, betas),
# sched (schedule, convention, warmup_type, warmup_steps), dtype, offload, growth (fp16 loss_scale_window)
CASES: list[tuple[str, dict[str, Any], dict[str, Any] | str]] = [
    (
        "huggingface/transformers tests/deepspeed/ds_config_zero2.json",
        {
            "fp16": {
                "enabled": "auto",
                "loss_scale": 0,
                "loss_scale_window": 1000,
                "initial_scale_power": 16,
                "hysteresis": 2,
                "min_loss_scale": 1,
            },
            "bf16": {"enabled": "auto"},
            "optimizer": _HF_AUTO_OPT,
            "scheduler": _HF_AUTO_SCHED,
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "allgather_partitions": True,
                "overlap_comm": True,
                "reduce_bucket_size": 2e8,
            },
            **_HF_AUTO_BATCH,
            "steps_per_print": 2000,
            "wall_clock_breakdown": False,
        },
        {
            "strategy": "zero2",
            "offload": True,
            "batch": (32, 8, 2),
            "optim": ("adamw", 3e-3, 0.01, (0.9, 0.95)),
            "sched": ("constant", "deepspeed", "log", 20),
            "dtype": "fp32",
        },
    ),
    (
        "huggingface/transformers tests/deepspeed/ds_config_zero3.json",
        {
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "loss_scale_window": 1000,
                "initial_scale_power": 16,
                "hysteresis": 2,
                "min_loss_scale": 1,
            },
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "offload_param": {"device": "cpu", "pin_memory": True},
                "sub_group_size": 1e14,
            },
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
            },
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500},
            },
            "steps_per_print": 2000,
            "wall_clock_breakdown": False,
        },
        {
            "strategy": "fsdp",
            "offload": True,
            "batch": (32, 8, 2),
            "optim": ("adamw", 3e-5, 3e-7, (0.8, 0.999)),
            "sched": ("constant", "deepspeed", "log", 500),
            "dtype": "fp16",
            "growth": 1000,
        },
    ),
    (
        "huggingface/transformers tests/deepspeed/ds_config_zero3_bf16.json",
        {
            "bfloat16": {"enabled": "auto"},
            "optimizer": _HF_AUTO_OPT,
            "scheduler": _HF_AUTO_SCHED,
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "offload_param": {"device": "cpu", "pin_memory": True},
                "reduce_bucket_size": "auto",
            },
            **_HF_AUTO_BATCH,
            "steps_per_print": 2000,
        },
        {"strategy": "fsdp", "offload": True, "batch": (32, 8, 2), "dtype": "fp32"},
    ),
    (
        "microsoft/DeepSpeedExamples cifar/ds_config.json",
        {
            "train_batch_size": 4,
            "steps_per_print": 2000,
            "optimizer": {
                "type": "Adam",
                "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
            },
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
            },
            "gradient_clipping": 1.0,
            "prescale_gradients": False,
            "fp16": {
                "enabled": True,
                "fp16_master_weights_and_grads": True,
                "loss_scale": 0,
                "loss_scale_window": 500,
                "hysteresis": 2,
                "min_loss_scale": 1,
                "initial_scale_power": 15,
            },
            "zero_optimization": {
                "stage": 2,
                "reduce_bucket_size": 50000000,
                "overlap_comm": True,
                "cpu_offload": True,
            },
        },
        {
            "strategy": "zero2",
            "offload": True,
            "batch": (4, 2, 1),
            "optim": ("adamw", 1e-3, 3e-7, (0.8, 0.999)),
            "sched": ("constant", "deepspeed", "log", 1000),
            "dtype": "fp16",
            "growth": 500,
            "clip": 1.0,
            "init_scale": 2.0**15,
        },
    ),
    (
        "microsoft/DeepSpeedExamples cifar/ds_config_lamb.json",
        {
            "train_batch_size": 1024,
            "train_micro_batch_size_per_gpu": 16,
            "optimizer": {"type": "Lamb", "params": {"lr": 5e-3, "weight_decay": 0.01, "max_coeff": 0.3}},
            "fp16": {"enabled": False, "loss_scale": 0},
        },
        {"strategy": "ddp", "batch": (1024, 16, 32), "optim": ("lamb", 5e-3, 0.01, (0.9, 0.999)), "dtype": "fp32",
         "lamb": (0.3, 0.01, True, False)},
    ),
    (
        "microsoft/DeepSpeedExamples cifar/ds_config_onebitlamb.json",
        {
            "train_batch_size": 1024,
            "train_micro_batch_size_per_gpu": 16,
            "optimizer": {"type": "OneBitLamb", "params": {"lr": 5e-3, "freeze_step": 1000}},
        },
        {"strategy": "ddp", "batch": (1024, 16, 32), "optim": ("onebit_lamb", 5e-3, 0.0, (0.9, 0.999)),
         "lamb": (10.0, 0.01, True, False), "freeze_step": 1000},
    ),
    (
        "microsoft/DeepSpeedExamples BingBertSquad/deepspeed_bsz24_config.json",
        {
            "train_batch_size": 24,
            "train_micro_batch_size_per_gpu": 6,
            "steps_per_print": 10,
            "optimizer": {
                "type": "Adam",
                "params": {"lr": 3e-5, "max_grad_norm": 1.0, "weight_decay": 0.0, "bias_correction": False},
            },
            "fp16": {"enabled": True},
        },
        {
            "strategy": "ddp",
            "batch": (24, 6, 2),
            "optim": ("adamw", 3e-5, 0.0, (0.9, 0.999)),
            "sched": ("constant", "dptrain", "linear", 0),
            "dtype": "fp16",
            "growth": 1000,
            "clip": 1.0,  # gradient_clipping absent: DeepSpeed's default 1.0 (since 0.19.3)
        },
    ),
    (
        "microsoft/DeepSpeedExamples BingBertSquad/onebit_deepspeed_bsz24_config.json",
        {
            "train_batch_size": 96,
            "train_micro_batch_size_per_gpu": 3,
            "optimizer": {"type": "OnebitAdam", "params": {"lr": 3e-5, "freeze_step": 400}},
            "fp16": {"enabled": True},
        },
        {"strategy": "ddp", "batch": (96, 3, 16), "optim": ("onebit_adam", 3e-5, 0.0, (0.9, 0.999)), "dtype": "fp16"},
    ),
    (
        "microsoft/DeepSpeedExamples Megatron-LM/scripts/ds_config.json",
        {
            "train_batch_size": 16,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 1,
            "zero_optimization": True,
            "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "max_grad_norm": 1.0}},
            "fp16": _FP16_MEGATRON,
        },
        {"strategy": "zero1", "batch": (16, 8, 1), "optim": ("adamw", 1.5e-4, 0.0, (0.9, 0.999)), "dtype": "fp16"},
    ),
    (
        "microsoft/DeepSpeedExamples Megatron-LM/scripts/ds_zero2_config.json",
        {
            "train_batch_size": 16,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
            "gradient_clipping": 1.0,
            "fp16": _FP16_MEGATRON,
            "activation_checkpointing": {"partition_activations": True},
        },
        {
            "strategy": "zero2",
            "offload": False,
            "batch": (16, 8, 1),
            "optim": ("adamw", 1.5e-4, 0.0, (0.9, 0.999)),
            "sched": ("constant", "dptrain", "linear", 0),
            "dtype": "fp16",
        },
    ),
    (
        "microsoft/DeepSpeedExamples Megatron-LM/scripts/ds_zero2_cpu_offload_config.json",
        {
            "train_batch_size": 16,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 2, "cpu_offload": True},
            "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
            "fp16": _FP16_MEGATRON,
        },
        {"strategy": "zero2", "offload": True, "batch": (16, 8, 1), "dtype": "fp16"},
    ),
    (
        "microsoft/DeepSpeedExamples Megatron-LM/scripts/ds_zero3_config.json",
        {
            "train_batch_size": 16,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3},
            "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
            "gradient_clipping": 1.0,
            "fp16": _FP16_MEGATRON,
        },
        {"strategy": "fsdp", "offload": False, "batch": (16, 8, 1), "optim": ("adamw", 1.5e-4, 0.0, (0.9, 0.999))},
    ),
    (
        "microsoft/DeepSpeedExamples Megatron-LM/scripts/ds_zero-offload_config.json",
        {
            "train_micro_batch_size_per_gpu": 12,
            "gradient_accumulation_steps": 5,
            "optimizer": {"type": "DeepSpeed_Adam", "params": {"lr": 0.00015, "weight_decay": 1e-2}},
            "zero_optimization": {"stage": 2, "cpu_offload": True, "reduce_bucket_size": 50000000},
            "gradient_clipping": 1.0,
            "fp16": _FP16_MEGATRON,
        },
        {"strategy": "zero2", "offload": True, "batch": (120, 12, 5), "optim": ("adamw", 1.5e-4, 0.01, (0.9, 0.999))},
    ),
    (
        "microsoft/DeepSpeedExamples Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_3_config.json",
        {
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "reduce_bucket_size": 6.710886e7},
            "gradient_clipping": 1.0,
            "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": 1000},
            "zero_allow_untested_optimizer": False,
        },
        {"strategy": "fsdp", "batch": (16, 8, 1), "dtype": "fp16", "init_scale": 2.0**10},
    ),
    (
        "microsoft/DeepSpeedExamples Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_infinity_config.json",
        {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme_data"},
                "offload_param": {"device": "nvme", "nvme_path": "/nvme_data"},
            },
            "fp16": {"enabled": True, "loss_scale": 1024},
        },
        {"strategy": "fsdp", "offload": True, "nvme": "/nvme_data", "batch": (8, 4, 1), "dtype": "fp16"},
    ),
    (
        "microsoft/DeepSpeedExamples Megatron-LM-v1.1.5-ZeRO3/curriculum_learning/ds_zero_stage_2_config_baseline.json",
        {
            "train_batch_size": 512,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 50000000, "overlap_comm": True},
            "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "max_grad_norm": 1.0, "betas": [0.9, 0.95]}},
            "gradient_clipping": 1.0,
            "fp16": _FP16_MEGATRON,
        },
        {"strategy": "zero2", "batch": (512, 256, 1), "optim": ("adamw", 1.5e-4, 0.0, (0.9, 0.95))},
    ),
    (
        "microsoft/DeepSpeedExamples QANet-Pytorch/ds_bsz512_1cycle.json",
        {
            "train_batch_size": 512,
            "train_micro_batch_size_per_gpu": 32,
            "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.004, "cycle_max_lr": 0.015}},
        },
        {"batch": (512, 32, 8), "sched": ("onecycle", "dptrain", "linear", 0), "lr": 0.015},
    ),
    (
        "microsoft/DeepSpeedExamples QANet-Pytorch/ds_bsz512_warmup.json",
        {
            "train_batch_size": 32,
            "optimizer": {
                "type": "Adam",
                "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
            },
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
            },
        },
        {
            "strategy": "ddp",
            "batch": (32, 16, 1),
            "optim": ("adamw", 1e-3, 3e-7, (0.8, 0.999)),
            "sched": ("constant", "deepspeed", "log", 1000),
            "dtype": "fp32",
        },
    ),
    (
        "microsoft/DeepSpeedExamples QANet-Pytorch/short_deepspeed_adam.json",
        {
            "train_batch_size": 32,
            "optimizer": {
                "type": "Adam",
                "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
            },
        },
        {
            "batch": (32, 16, 1),
            "optim": ("adamw", 1e-3, 3e-7, (0.8, 0.999)),
            "sched": ("constant", "dptrain", "linear", 0),
        },
    ),
    (
        "microsoft/DeepSpeedExamples autotuning/hf/dsconfigs/ds_config_fp16_z2.json",
        {
            "train_micro_batch_size_per_gpu": "auto",
            "zero_optimization": {"stage": 2},
            "fp16": {"enabled": True},
        },
        {"strategy": "zero2", "batch": (32, 8, 2), "dtype": "fp16", "growth": 1000, "init_scale": 2.0**16},
    ),
    (
        "microsoft/DeepSpeedExamples autotuning/hf/dsconfigs/ds_config_z1.json",
        {
            "train_micro_batch_size_per_gpu": "auto",
            "zero_optimization": {"stage": 1},
        },
        {"strategy": "zero1", "batch": (32, 8, 2), "dtype": "fp32", "sched": ("constant", "dptrain", "linear", 0)},
    ),
    (
        "microsoft/DeepSpeedExamples bing_bert/deepspeed_bsz4096_adam_config.json",
        {
            "train_batch_size": 4096,
            "train_micro_batch_size_per_gpu": 64,
            "optimizer": {
                "type": "Adam",
                "params": {"lr": 2e-4, "max_grad_norm": 1.0, "weight_decay": 0.01, "bias_correction": False},
            },
            "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
        },
        {"batch": (4096, 64, 32), "optim": ("adamw", 2e-4, 0.01, (0.9, 0.999)), "dtype": "fp16"},
    ),
    (
        "microsoft/DeepSpeedExamples bing_bert/deepspeed_bsz64k_lamb_config_seq128.json",
        {
            "train_batch_size": 65536,
            "train_micro_batch_size_per_gpu": 64,
            "optimizer": {"type": "Lamb", "params": {"lr": 11e-3, "weight_decay": 0.01}},
            "fp16": {"enabled": True},
            "sparse_attention": {"mode": "fixed", "block": 16},
        },
        r"sparse_attention is not supported: DeepSpeed removed",
    ),
    (
        "microsoft/DeepSpeedExamples bing_bert/deepspeed_bsz32K_lamb_config_seq512.json",
        {
            "train_batch_size": 32768,
            "train_micro_batch_size_per_gpu": 16,
            "steps_per_print": 1000,
            "prescale_gradients": False,
            "optimizer": {
                "type": "Lamb",
                "params": {"lr": 4e-3, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3,
                           "min_coeff": 0.01},
            },
            "gradient_clipping": 1.0,
            "wall_clock_breakdown": False,
            "fp16": {"enabled": True, "loss_scale": 0},
        },
        {
            "strategy": "ddp",
            "batch": (32768, 16, 1024),
            "optim": ("lamb", 4e-3, 0.01, (0.9, 0.999)),
            "lamb": (0.3, 0.01, False, False),
            "dtype": "fp16",
            "clip": 1.0,
        },
    ),
    (
        "microsoft/DeepSpeed tests/model/Megatron_GPT2/ds_config_func_scheduler.json",
        {
            "train_batch_size": 4,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 2},
            "gradient_clipping": 1.0,
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 10},
            },
            "fp16": _FP16_MEGATRON,
        },
        {"strategy": "zero2", "batch": (4, 2, 1), "lr": 1e-3, "sched": ("constant", "deepspeed", "log", 10)},
    ),
    (
        "microsoft/DeepSpeed tests/model/Megatron_GPT2/ds_config_func_bs4_zero2_offload.json",
        {
            "train_batch_size": 4,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {
                "stage": 2,
                "reduce_bucket_size": 7000000,
                "reduce_scatter": True,
                "cpu_offload": True,
            },
            "gradient_clipping": 1.0,
            "fp16": _FP16_MEGATRON,
        },
        {"strategy": "zero2", "offload": True, "batch": (4, 2, 1)},
    ),
    (
        "microsoft/DeepSpeed tests/model/Megatron_GPT2/ds_config_func_bs8_zero0_gas3.json",
        {
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 3,
            "zero_optimization": {"stage": 0, "reduce_bucket_size": 7000000, "reduce_scatter": True},
            "gradient_clipping": 1.0,
            "fp16": _FP16_MEGATRON,
        },
        {"strategy": "ddp", "batch": (48, 8, 3), "bucket_cap_mb": 7000000 * 4 / 2**20},
    ),
    (
        "microsoft/DeepSpeed tests/model/Megatron_GPT2/ds_config_perf_bs16.json",
        {
            "train_batch_size": 16,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 1},
            "disable_allgather": True,
            "gradient_clipping": 1.0,
            "fp16": _FP16_MEGATRON,
        },
        {"strategy": "zero1", "batch": (16, 8, 1), "dtype": "fp16"},
    ),
    (
        "microsoft/DeepSpeed tests/model/Megatron_GPT2/ds_config_func_bs8_no_zero.json",
        {
            "train_batch_size": 8,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 0},
            "gradient_clipping": 1.0,
            "fp16": _FP16_MEGATRON,
        },
        {"strategy": "ddp", "batch": (8, 4, 1), "dtype": "fp16", "growth": 1000},
    ),
    (
        "issue 7's example (the project's source material)",
        {
            "train_batch_size": 1024,
            "gradient_accumulation_steps": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 6e-5}},
            "fp16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "pipeline": {"stages": 4, "micro_batch_size": 32},
        },
        {
            "world": 16,
            "strategy": "fsdp",
            "offload": True,
            "batch": (1024, 256, 1),
            "pp": (4, 8, "1f1b"),
            "optim": ("adamw", 6e-5, 0.0, (0.9, 0.999)),
            "dtype": "fp16",
        },
    ),
]
