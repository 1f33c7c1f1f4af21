"""Evaluation: perplexity through the compressed cache, decode benchmarks (more to come).

Installed as `kvjax.eval`; uses only kvjax's public API.
"""

from kvjax.eval._bench import DecodeBench, bench_decode
from kvjax.eval._ppl import PplResult, essay_tokens, run_ppl

__all__ = ["DecodeBench", "PplResult", "bench_decode", "essay_tokens", "run_ppl"]
