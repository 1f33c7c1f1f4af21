"""Soak: 20K decode steps per bounded policy in one compiled loop on a tiny random model (CPU).

Invariants are accumulated inside the loop (no per-step host sync): the attended tokens never
exceed the budget (QEvict: its byte bound), logits and cache stay finite, positions strictly
increase; the loop compiles once, and host memory (RSS) stays flat across the calls."""

import functools
import os
import resource

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from policy_cases import NAMES, build

from kvjax.cache import attended_slots_per_layer, slot_bytes_per_layer
from kvjax.generate import model_step, new_cache

STEPS = int(os.environ.get("KVJAX_SOAK_STEPS", "20000"))
CALLS = 4  # the steps run as CALLS calls of one compiled loop (RSS sampled between them)
BUDGET = 20


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _finite(tree) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _max_pos(cache) -> jax.Array:
    """[B] newest cached position over every tier of every layer."""
    out = []
    for layer in cache.layers:
        out.append(jnp.max(layer.pos, axis=(1, 2)))
        if layer.int8 is not None:
            out.append(jnp.max(layer.int8.pos, axis=(1, 2)))
        if layer.lowbit is not None:
            out.append(jnp.max(layer.lowbit.pos, axis=(1, 2, 3)))
    return jnp.max(jnp.stack(out), axis=0)


# The tests compile at LLVM -O0 (tests/conftest.py); this loop runs 20K steps, so it is worth
# LLVM's optimizations (-O2, XLA's default): less CPU in all (docs/lab/2026-12-01-test-time.md).
@functools.partial(
    jax.jit,
    static_argnums=(0, 1),
    donate_argnums=(4,),
    compiler_options={"xla_backend_optimization_level": 2},
)
def _soak(config, policy, n, params, cache, key, logits):
    """n decode steps sampling from the model itself; returns the carry and accumulated flags:
    peak attended units [B, L, 3] (per unit, over steps), peak attended bytes [B] (per step),
    all finite, positions strictly increasing."""
    b = logits.shape[0]
    unit = jnp.asarray(slot_bytes_per_layer(cache), jnp.int32)  # [L, 3], static sizes

    def body(i, carry):
        cache, key, logits, peak, peak_bytes, finite, increasing = carry
        key, sub = jax.random.split(key)
        tok = jax.random.categorical(sub, logits).astype(jnp.int32)
        before = cache.length
        logits, cache = model_step(
            config, policy, params, cache, tok[:, None], jnp.ones((b, 1), bool)
        )
        logits = logits[:, 0]
        units = attended_slots_per_layer(cache)
        peak = jnp.maximum(peak, units)
        peak_bytes = jnp.maximum(peak_bytes, jnp.sum(units * unit[None], axis=(1, 2)))
        finite = finite & jnp.all(jnp.isfinite(logits)) & _finite(cache)
        # The step's token took position `before`, one past the last, and is the newest cached.
        increasing = increasing & jnp.all(cache.length == before + 1)
        increasing = increasing & jnp.all(_max_pos(cache) == before)
        return cache, key, logits, peak, peak_bytes, finite, increasing

    peak0 = jnp.zeros((b, config.num_layers, 3), jnp.int32)
    init = (cache, key, logits, peak0, jnp.zeros((b,), jnp.int32), jnp.bool_(True), jnp.bool_(True))
    return jax.lax.fori_loop(0, n, body, init)


@pytest.mark.parametrize("case", [c for c in NAMES if c not in ("full", "kivi")])
def test_soak_20k_steps_stays_bounded_finite_and_flat(tiny_llama, case):
    config, params = tiny_llama
    policy = build(case, BUDGET)
    b = 2
    cache = new_cache(config, policy, batch=b, max_len=STEPS + 1, dtype=jnp.float32)
    key = jax.random.key(0)
    logits = jnp.zeros((b, config.vocab_size), jnp.float32)
    per_call = STEPS // CALLS
    rss, peak_bytes = [], 0
    _soak._clear_cache()
    for _ in range(CALLS):
        cache, key, logits, peak, step_bytes, finite, increasing = _soak(
            config, policy, per_call, params, cache, key, logits
        )
        assert bool(finite), "NaN/Inf in logits or cache"
        assert bool(increasing), "positions did not strictly increase"
        peak_bytes = max(peak_bytes, int(np.asarray(step_bytes).max()))
        if case != "qevict":
            tokens = np.asarray(peak)[..., :2].sum(-1)  # [B, L] full + INT8 slots, all heads
            cap = [getattr(policy, "max_budget", lambda _: BUDGET)(li) for li in range(2)]
            assert np.all(tokens <= config.num_kv_heads * np.asarray(cap)[None, :])
        rss.append(_rss_mib())
    assert int(cache.length[0]) == per_call * CALLS
    assert _soak._cache_size() == 1, "the loop recompiled"
    tok_bytes = 2 * config.head_dim * 4
    bound = config.num_layers * config.num_kv_heads * BUDGET * tok_bytes
    assert peak_bytes <= bound
    if case == "qevict":  # its budget is bytes: the routed tiers fill to within a window of it
        assert peak_bytes > bound - 8 * config.num_layers * config.num_kv_heads * tok_bytes
    # Host memory flat: the last call adds nothing worth a leak (first call = compile).
    assert rss[-1] - rss[1] < 16, rss
