"""The generate loop and its building blocks."""

from kvjax.generate._loop import generate
from kvjax.generate._sampling import GREEDY, Sampling, sample
from kvjax.generate._score import ScoreOutput, score_tokens
from kvjax.generate._step import cache_spec_for, model_step, new_cache
from kvjax.generate._stream import decode, generate_from_cache, prefill, prefill_cache
from kvjax.generate._types import GenerateConfig, GenerateOutput, Telemetry

__all__ = [
    "GREEDY",
    "GenerateConfig",
    "GenerateOutput",
    "Sampling",
    "ScoreOutput",
    "Telemetry",
    "cache_spec_for",
    "decode",
    "generate",
    "generate_from_cache",
    "model_step",
    "new_cache",
    "prefill",
    "prefill_cache",
    "sample",
    "score_tokens",
]
