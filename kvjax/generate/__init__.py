"""The generate loop and its building blocks.

The package is callable: `kvjax.generate(config, params, prompts, policy=..., gen=...)` runs
`generate`.
"""

import sys as _sys
from types import ModuleType as _ModuleType

from kvjax.generate._fit import fit_policy
from kvjax.generate._loop import generate
from kvjax.generate._sampling import GREEDY, Sampling, sample
from kvjax.generate._score import ScoreOutput, score_tokens
from kvjax.generate._step import cache_spec_for, model_step, new_cache, write_stacked
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
    "fit_policy",
    "generate",
    "generate_from_cache",
    "model_step",
    "new_cache",
    "prefill",
    "prefill_cache",
    "sample",
    "score_tokens",
    "write_stacked",
]


class _CallablePackage(_ModuleType):
    """This package, callable: `kvjax.generate(...)` is `kvjax.generate.generate(...)`, so the
    function and the subpackage share one name (docs/decisions.md)."""

    def __call__(self, *args, **kwargs) -> GenerateOutput:
        return generate(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallablePackage
