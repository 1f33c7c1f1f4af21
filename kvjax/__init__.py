"""kvjax: bounded, compressed KV caches for jit-compiled LLM decoding in JAX.

Names (imported lazily, on first use):

| name | what |
|---|---|
| `load(model=None, *, dtype=...)` | an `LM`: the embedded SmolLM2, a GGUF file, an HF folder |
| `LM` | config + params + tokenizer; `generate`, `chat`, `ppl` (text in, text out) |
| `GenerationResult` | `.text`, `.tokens`, `.telemetry` of `LM.generate` / `LM.chat` |
| `PerplexityResult` | `.ppl`, `.nll` of `LM.ppl` |
| `policies` | the cache policies (`policies.make_policy`, `policies.H2OPolicy`, ...) |
| `make_policy(name, budget, ...)` | a policy by name (same as `policies.make_policy`) |
| `generate(config, params, prompts, *, policy, gen)` | the functional core: one jit |
| `model_step(config, policy, params, cache, tokens, valid)` | one pure step for own loops |
| `new_cache(config, policy, *, batch, max_len, dtype)` | an empty cache for a policy |
| `score_tokens(config, params, tokens, *, policy)` | teacher-forced NLL through a cache |
| `GenerateConfig`, `Sampling`, `GenerateOutput`, `Telemetry` | the core's settings and outputs |
| `__version__` | the package version |

`kvjax.generate` is both the subpackage (`import kvjax.generate as kg; kg.generate(...)`) and
the function (`kvjax.generate(config, params, prompts, policy=..., gen=...)`).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it; a name equal to its module's last part is the module itself.
_EXPORTS = {
    "LM": "kvjax._lm",
    "GenerationResult": "kvjax._results",
    "PerplexityResult": "kvjax._results",
    "load": "kvjax._lm",
    "policies": "kvjax.policies",
    "make_policy": "kvjax.policies",
    "generate": "kvjax.generate",  # the package; calling it calls generate.generate
    "model_step": "kvjax.generate",
    "new_cache": "kvjax.generate",
    "score_tokens": "kvjax.generate",
    "GenerateConfig": "kvjax.generate",
    "GenerateOutput": "kvjax.generate",
    "Sampling": "kvjax.generate",
    "Telemetry": "kvjax.generate",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvjax' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if module.rsplit(".", 1)[-1] == name else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
