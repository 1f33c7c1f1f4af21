"""Lists the copies of cache-sized arrays in a compiled decode loop, per policy (a debugging aid:
an in-place decode step should copy none). Usage: python scripts/find_cache_copies.py [POLICY...]
(POLICY@pallas or POLICY@xla: a ranked policy with that write_kernel; default "auto").
With DUMP_HLO=DIR it also writes each compiled module's text there; STACKED=1 compiles the
layer-scan step over a stacked cache; ATTN=pallas|xla picks the attention (default "auto");
BATCH=N the batch (default 2)."""

import collections
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

from kvjax.cache import stack_cache
from kvjax.eval._bench import (
    _decode,
    _policy_only,
    cache_sized_shapes,
    hlo_copies,
    hlo_loop_launches,
    policy_from_spec,
)
from kvjax.generate import new_cache
from kvjax.models import PRESETS, init_params, stack_params

CTX = 4096
BATCH = int(os.environ.get("BATCH", "2"))
cfg = dataclasses.replace(PRESETS["Llama-3-8B"], num_layers=2, vocab_size=1024)
params = init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
# (kvpop is not listed: its shipped scorers fit SmolLM2's shapes only)
budgets = {"confkv": 1580, "qevict": 819, "h2o": 819, "kivi": None, "full": None}
for spec in sys.argv[1:] or list(budgets):
    pol = policy_from_spec(spec, budgets.get(spec.partition("@")[0], 819), num_layers=2)
    cache = new_cache(cfg, pol, batch=BATCH, max_len=CTX, dtype=jnp.bfloat16)
    big = cache_sized_shapes(cache, cfg.head_dim)
    p = params
    if os.environ.get("STACKED") == "1":  # a copy of one layer's slice or of the stack counts
        big |= {(2, *s) for s in big}
        cache, p = stack_cache(cache), stack_params(params, cfg)
    attn = os.environ.get("ATTN", "auto")
    for label, lowered in (
        ("policy", _policy_only.lower(pol, 4, cache, jax.random.key(0))),
        ("decode", _decode.lower(cfg, pol, 4, attn, p, cache, jnp.zeros((BATCH,), jnp.int32))),
    ):
        text = lowered.compile().as_text()
        if os.environ.get("DUMP_HLO"):  # the compiled module, for reading its kernels
            with open(os.path.join(os.environ["DUMP_HLO"], f"{spec}_{label}.hlo.txt"), "w") as f:
                f.write(text)
        hits = collections.Counter(hlo_copies(text, big))
        launches = hlo_loop_launches(text)
        print(
            jax.default_backend(),
            spec,
            label,
            dict(hits) or "no cache-sized copies",
            f"| {sum(launches.values())} launches per step {dict(sorted(launches.items()))}",
            flush=True,
        )
