"""`dp`: legacy single-process `nn.DataParallel` over the local GPUs.

Kept for completeness and for old scripts. It replicates the model onto every GPU on each
forward and gathers outputs on GPU 0, so GPU 0 holds more memory than the others and the
single Python process becomes the bottleneck; DDP is faster on every setup PyTorch measures.
"""

from __future__ import annotations

import torch
from torch import nn


def apply_dp(model: nn.Module, *, device: torch.device) -> nn.Module:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("strategy 'dp' (nn.DataParallel) needs CUDA GPUs; use 'ddp', which also runs on the CPU")
    return nn.DataParallel(model.to(device))
