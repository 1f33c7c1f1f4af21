"""The generate loop and its building blocks."""

from kvjax.generate._loop import GenerateConfig, GenerateOutput, Telemetry, generate
from kvjax.generate._sampling import GREEDY, Sampling, sample
from kvjax.generate._score import ScoreOutput, score_tokens
from kvjax.generate._step import model_step, new_cache

__all__ = [
    "GREEDY",
    "GenerateConfig",
    "GenerateOutput",
    "Sampling",
    "ScoreOutput",
    "Telemetry",
    "generate",
    "model_step",
    "new_cache",
    "sample",
    "score_tokens",
]
