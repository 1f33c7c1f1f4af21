"""The generate loop's configuration and outputs."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import struct

from kvjax.attention import Implementation
from kvjax.cache import slots_to_bytes
from kvjax.generate._sampling import GREEDY, Sampling

Array = jax.Array


@struct.dataclass
class Telemetry:
    """Per decode step (rows past `steps` are zero).

    Attributes:
        confidence: [N, B] float32 CONF-KV confidence of the distribution the token came from.
        live_slots: [N, B, L, 3] int32 units the step attended per layer and tier (full
            slots, INT8 slots, low-bit pages), summed over KV heads: the occupied units after
            the step plus its current token (`kvjax.cache.attended_slots_per_layer`).
        budget: [N, B] int32 the policy's token budget chosen for the step (-1: fixed budget).
        steps: [] int32 number of decode steps run.
        slot_bytes: [L, 3] int32 K/V bytes of one unit of one KV head, per layer and tier.
    """

    confidence: Array
    live_slots: Array
    budget: Array
    steps: Array
    slot_bytes: Array

    def live_bytes(self) -> np.ndarray:
        """[N, B] int64 live K/V bytes after each step (host side, exact)."""
        return slots_to_bytes(np.asarray(self.live_slots), np.asarray(self.slot_bytes, np.int64))


@struct.dataclass
class GenerateOutput:
    """Attributes:
    tokens: [B, N] int32 generated ids (pad after a stop token; the stop token is included).
    num_generated: [B] int32 tokens generated per sequence.
    telemetry: per-step Telemetry.
    """

    tokens: Array
    num_generated: Array
    telemetry: Telemetry


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """Static settings of a generation (hashable: one compilation per distinct value).

    Attributes:
        max_new_tokens: N, tokens generated per sequence at most.
        sampling: greedy / temperature / top-p.
        stop_tokens: ids that end a sequence (included in the output).
        chunk_size: prompt tokens per prefill call (a prompt longer than the cache streams
            through the policy chunk by chunk).
        cache_dtype: storage dtype of the full-precision cache tier (None: the params' dtype).
        implementation: attention implementation.
        pad_id: id written after a sequence stops.
        scan_layers: run the model's layers in one `lax.scan` over a stacked cache (the layer
            compiled once, not once per layer: a first call several times shorter; the same
            tokens). Not for per-layer budgets (pyramid: ValueError) nor on a mesh. Pass the
            params through `kvjax.models.stack_params` once to spare a copy of the layer
            weights per call (docs/compile.md).
    """

    max_new_tokens: int
    sampling: Sampling = GREEDY
    stop_tokens: tuple[int, ...] = ()
    chunk_size: int = 256
    cache_dtype: str | None = None
    implementation: Implementation = "auto"
    pad_id: int = 0
    scan_layers: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
