"""Model and data factories shipped with dptrain."""

from dptrain.models.llama import LlamaLM, build_llama
from dptrain.models.toy import build_mlp, build_regression_data

__all__ = ["LlamaLM", "build_llama", "build_mlp", "build_regression_data"]
