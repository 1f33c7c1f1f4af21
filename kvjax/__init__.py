"""kvjax: bounded, compressed KV caches for jit-compiled LLM decoding in JAX."""

__version__ = "0.1.0"
