"""Decoder-only models as pure functions over explicit parameter pytrees and the slot cache."""

from kvjax.models._config import (
    LLAMA3_8B,
    PRESETS,
    SMOLLM2_135M,
    TINY_GPT2,
    TINY_LLAMA,
    Arch,
    ModelConfig,
    RopeScaling,
)
from kvjax.models._forward import ForwardOutput, forward, rope_rotation
from kvjax.models._params import (
    GPT2Layer,
    GPT2Params,
    LlamaLayer,
    LlamaParams,
    Params,
    fuse_projections,
    init_params,
    stack_params,
)

__all__ = [
    "LLAMA3_8B",
    "PRESETS",
    "SMOLLM2_135M",
    "TINY_GPT2",
    "TINY_LLAMA",
    "Arch",
    "ForwardOutput",
    "GPT2Layer",
    "GPT2Params",
    "LlamaLayer",
    "LlamaParams",
    "ModelConfig",
    "Params",
    "RopeScaling",
    "forward",
    "fuse_projections",
    "init_params",
    "rope_rotation",
    "stack_params",
]
