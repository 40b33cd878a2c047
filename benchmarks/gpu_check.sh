#!/usr/bin/env bash
# One command for a lent GPU machine (under 5 minutes): NCCL ddp/fsdp smoke runs, the bf16 MFU of a
# ~1B LLaMA with torch.compile, dp vs ddp. Prints one table; exits 1 at once without a CUDA GPU.
# Usage: bash benchmarks/gpu_check.sh [--out DIR] [--quick]   (see benchmarks/acceptance/gpu_check.py)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python}" "$here/acceptance/gpu_check.py" "$@"
