"""Decode-speed benchmark: steady-state decode steps over a cache filled to a given context.

The cache is filled synthetically (random K/V written through the policy, no model forward), so
32K-token contexts of 8B-shaped models cost seconds; each timed step is a real model step.
Reports time per step, tokens/s and bytes read per step against a measured copy bandwidth, the
policy's own per-step cost (its cache update timed alone, without the model or attention) and
the device allocator's peak (on GPU/TPU; run one policy per process for a per-policy peak).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention import AttnStats
from kvjax.cache import Cache, is_stacked, live_bytes, physical_bytes
from kvjax.generate import model_step, new_cache, write_stacked
from kvjax.models import ModelConfig, Params, stack_params
from kvjax.pallas_kernels.decode_attention import tuning_overrides
from kvjax.policies import BUDGETLESS, Policy, make_policy


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeBench:
    """One decode measurement (JSON-ready via dataclasses.asdict)."""

    model: str
    policy: str
    budget: int | None
    batch: int
    context: int
    steps: int
    dtype: str
    device: str
    ms_per_step: float
    tokens_per_s: float
    weight_bytes: int
    live_kv_bytes: int
    physical_kv_bytes: int
    floor_ms: float  # (weights + live KV) bytes / measured copy bandwidth
    copy_gbps: float  # measured device copy bandwidth (bytes read + written)
    achieved_gbps: float  # (weights + live KV) bytes read per step / time per step
    policy_ms_per_step: float  # the policy's cache update alone (write of one token, all layers)
    peak_device_bytes: int | None  # the device allocator's peak so far (None where unreported)
    fill_s: float  # wall time of the synthetic fill (its compile included)
    first_call_s: float  # wall time of the first decode loop call (compile + `steps` steps)
    scan_layers: bool = False  # the layers ran in one lax.scan over a stacked cache
    tuning: str = ""  # the KVJAX_TUNING overrides of the decode kernels' Tuning ("" = none)
    # --mesh runs only: the mesh, each device's live / physical K/V bytes and the collectives of
    # one compiled decode step (opcode -> instructions), read from its HLO.
    mesh: str | None = None
    live_kv_bytes_per_device: list[int] | None = None
    physical_kv_bytes_per_device: list[int] | None = None
    collectives_per_step: dict[str, int] | None = None


def _random_stats(layer, key: jax.Array, b: int, t: int) -> AttnStats:
    """Random attention masses for every tier of `layer` and `t` new tokens per sequence (a
    stacked layer: every array with its leading [L] axis)."""
    lead = layer.pos.shape[:-3]  # () or (L,)
    tier = lambda x: None if x is None else jax.random.uniform(key, x.pos.shape)
    return AttnStats(
        slot_mass=jax.random.uniform(key, layer.pos.shape),
        new_mass=jax.random.uniform(key, (*lead, b, layer.k.shape[-3], t)),
        lse=jnp.zeros((*lead, b, t, 1)),
        int8_mass=tier(layer.int8),
        lowbit_mass=tier(layer.lowbit),
    )


def _random_kv(layer, kk: jax.Array, kv: jax.Array, b: int, t: int) -> tuple[jax.Array, ...]:
    """Random new K and V [(L,) B, T, Hkv, D] for `layer` (drawn apart: slices of one [2, ...]
    draw ran as two device copies per layer and step inside the timed loop, H200 trace,
    docs/lab/2026-12-01-policy-trace.md)."""
    lead, (h, d) = layer.pos.shape[:-3], (layer.k.shape[-3], layer.k.shape[-1])
    shape = (*lead, b, t, h, d)
    return (
        jax.random.normal(kk, shape, layer.k.dtype),
        jax.random.normal(kv, shape, layer.v.dtype),
    )


def _random_inputs(cache: Cache, key: jax.Array, t: int):
    """Random (k_new, v_new, stats) of `t` tokens for every layer: lists of one per layer for
    a per-layer cache, arrays with a leading [L] axis for a stacked one."""
    b = cache.length.shape[0]
    if is_stacked(cache):
        kk, kv, km = jax.random.split(key, 3)
        k, v = _random_kv(cache.layers, kk, kv, b, t)
        return k, v, _random_stats(cache.layers, km, b, t)
    k, v, stats = [], [], []
    for layer in cache.layers:
        key, kk, kv, km = jax.random.split(key, 4)
        new_k, new_v = _random_kv(layer, kk, kv, b, t)
        k, v = [*k, new_k], [*v, new_v]
        stats.append(_random_stats(layer, km, b, t))
    return k, v, stats


def _write_all(policy: Policy, cache: Cache, ks, vs, pos, valid, stats, state):
    """Every layer's write: `write_layers` over a per-layer cache, `write_stacked` (the layer
    scan's write) over a stacked one."""
    if is_stacked(cache):
        return write_stacked(policy, cache.layers, ks, vs, pos, valid, stats, state)
    return policy.write_layers(cache.layers, ks, vs, pos, valid, stats, state)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2,))
def _fill(policy: Policy, chunk: int, cache: Cache, key: jax.Array) -> Cache:
    """Write `chunk` random tokens per sequence through the policy (no model)."""
    b = cache.length.shape[0]
    pos = cache.length[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None]
    valid = jnp.ones((b, chunk), bool)
    k, v, stats = _random_inputs(cache, key, chunk)
    layers = _write_all(policy, cache, k, v, pos, valid, stats, cache.policy_state)
    return Cache(layers=layers, length=cache.length + chunk, policy_state=cache.policy_state)


def greedy_steps(
    config: ModelConfig,
    policy: Policy,
    steps: int,
    impl: str,
    params: Params,
    cache: Cache,
    tok: jax.Array,
) -> tuple[Cache, jax.Array]:
    """`steps` greedy decode steps from tokens tok [B] int32 (traced; the one loop body of the
    unsharded and the `--mesh` bench): (cache, last tokens [B] int32)."""

    def body(_, carry):
        cache, tok = carry
        valid = jnp.ones((tok.shape[0], 1), bool)
        logits, cache = model_step(
            config, policy, params, cache, tok[:, None], valid, implementation=impl
        )
        return cache, jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)

    return jax.lax.fori_loop(0, steps, body, (cache, tok))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))
def _decode(
    config: ModelConfig,
    policy: Policy,
    steps: int,
    impl: str,
    params: Params,
    cache: Cache,
    tok: jax.Array,
):
    return greedy_steps(config, policy, steps, impl, params, cache, tok)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2,))
def _policy_only(policy: Policy, steps: int, cache: Cache, key: jax.Array) -> Cache:
    """`steps` one-token writes through the policy, every layer, no model and no attention:
    the policy's own per-step cost. Inputs (K/V, masses) are drawn once outside the loop."""
    b = cache.length.shape[0]
    k, v, stats = _random_inputs(cache, key, 1)

    def body(_, cache):
        pos = cache.length[:, None]
        valid = jnp.ones((b, 1), bool)
        layers = _write_all(policy, cache, k, v, pos, valid, stats, cache.policy_state)
        return Cache(layers=layers, length=cache.length + 1, policy_state=cache.policy_state)

    return jax.lax.fori_loop(0, steps, body, cache)


def call_seconds(call: Callable[[Any], Any], state: Any, calls: int = 2) -> tuple[Any, list[float]]:
    """state = call(state) `calls` times; (state, wall seconds of each call, to its result)."""
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        state = call(state)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    return state, times


def second_call_seconds(call: Callable[[Any], Any], state: Any) -> tuple[Any, float]:
    """state = call(state) twice (the first compiles), timing the second; (state, seconds)."""
    state, times = call_seconds(call, state)
    return state, times[1]


def fill_random(
    policy: Policy, cache: Cache, tokens: int, chunk: int, key: jax.Array, progress: bool = False
) -> tuple[Cache, jax.Array]:
    """Write `tokens` random tokens per sequence through the policy, `chunk` per call (progress:
    a bar of the calls on stderr)."""
    calls = range(tokens // chunk)
    if progress:
        from tqdm.auto import tqdm

        calls = tqdm(calls, desc=f"fill [{policy.name}]", unit="chunk", leave=False)
    for _ in calls:
        key, sub = jax.random.split(key)
        cache = _fill(policy, chunk, cache, sub)
    return cache, key


def policy_seconds_per_step(
    policy: Policy, steps: int, cache: Cache, key: jax.Array
) -> tuple[Cache, float]:
    """The policy's own decode write, all layers, timed alone (`_policy_only`): (cache, s/step)."""
    cache, sec = second_call_seconds(lambda c: _policy_only(policy, steps, c, key), cache)
    return cache, sec / steps


def policy_from_spec(
    spec: str, budget: int | None, num_layers: int, sets: str | None = None
) -> Policy:
    """The policy NAME or NAME@WRITE_KERNEL (a ranked policy's `write_kernel`) at `budget` (the
    debugging scripts' command-line form; budgetless policies ignore both). `sets`: more
    fields as "FIELD=VALUE,..." (values as `--set` reads them; the scripts' PROBE_SET), e.g.
    "scorer=/tmp/kvpop_llama3.msgpack"."""
    name, _, writes = spec.partition("@")
    more = {}
    if sets:
        from kvjax.cli._common import policy_kwargs

        more = policy_kwargs(argparse.Namespace(set=[x for x in sets.split(",") if x]))
    if name in BUDGETLESS:
        return make_policy(name, **more)
    kw = dict(write_kernel=writes) if writes else {}
    return make_policy(name, budget, num_layers=num_layers, **kw, **more)


def cache_sized_shapes(cache, head_dim: int, ring: int = 64) -> set[tuple[int, ...]]:
    """Shapes of a cache's K/V-sized arrays, [B, Hkv, slots, head_dim] with more slots than a
    recent-token ring (the full-precision tier and the INT8 codes): what an in-place decode step
    must never copy. (Copying the small ring is cheap and sometimes what XLA chooses.)"""
    return {
        tuple(x.shape)
        for x in jax.tree.leaves(cache)
        if x.ndim == 4 and x.shape[2] > ring and x.shape[3] == head_dim
    }


def hlo_copies(hlo_text: str, shapes: set[tuple[int, ...]]) -> list[str]:
    """The `copy` instructions of compiled HLO text whose result has one of `shapes` (e.g. a
    cache's K/V shapes: an in-place decode step holds none), as "dtype[dims]" strings."""
    found = []
    for m in re.finditer(r"= (\w+)\[([0-9,]*)\]\{[^}]*\} copy\(", hlo_text):
        shape = tuple(int(s) for s in m.group(2).split(",") if s)
        if shape in shapes:
            found.append(f"{m.group(1)}{list(shape)}")
    return found


_NO_LAUNCH = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "opt-barrier"}


def _opcode(line: str) -> tuple[str, str] | None:
    """(name, opcode) of one HLO instruction line, None if it is not one."""
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                rest = rest[i + 1 :]
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    op = re.match(r"\s*([\w\-]+)\(", rest)
    return (m.group(1), op.group(1)) if op else None


def hlo_loop_launches(hlo_text: str) -> dict[str, int]:
    """What one iteration of the entry computation's largest while loop (the decode loop)
    launches, from compiled HLO text: fusions by kind, copies, custom calls, conds, and inner
    loops split by whether their trip count is known at compile time ("while (dynamic)" costs a
    device-to-host sync per iteration on GPU). Instructions that launch nothing (tuples,
    parameters, bitcasts, constants, barriers) are not counted."""
    comps: dict[str, list[str]] = {}
    entry, cur = None, None
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            cur = head.group(2)
            comps[cur] = []
            entry = cur if head.group(1) else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            comps[cur].append(line)

    def top_level(name: str) -> list[str]:  # a computation's lines and those it calls (the CPU
        # compiler wraps small loops in calls)
        lines = comps.get(name, [])
        called = [re.search(r"to_apply=%?([\w.\-]+)", ln) for ln in lines if " call(" in ln]
        return lines + [x for m in called if m for x in top_level(m.group(1))]

    bodies = [
        re.search(r"body=%?([\w.\-]+)", ln).group(1) for ln in top_level(entry) if " while(" in ln
    ]
    if not bodies:
        raise ValueError("the entry computation has no while loop")
    body = max(bodies, key=lambda b: len(comps[b]))  # the decode loop, not a random-bits loop
    counts: dict[str, int] = {}
    for line in top_level(body):
        parsed = _opcode(line)
        if parsed is None or parsed[1] in _NO_LAUNCH or parsed[1] == "call":
            continue
        op = parsed[1]
        if op == "fusion":
            kind = re.search(r"kind=(\w+)", line)
            op = f"fusion ({kind.group(1)})" if kind else op
        elif op == "while":
            op = "while (known trips)" if "known_trip_count" in line else "while (dynamic)"
        counts[op] = counts.get(op, 0) + 1
    return counts


def peak_device_bytes() -> int | None:
    """The first device's allocator peak (bytes) so far; None where the backend has no stats."""
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else int(peak)


def copy_bandwidth(n_bytes: int, iters: int = 10) -> float:
    """Measured device copy bandwidth in GB/s (bytes read + written): `iters` elementwise
    passes over an n_bytes buffer inside one jitted loop (no dispatch or allocation timed)."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda a: jax.lax.fori_loop(0, iters, lambda _, a: a * 1.0001, a))
    f(x).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * x.nbytes * iters / np.median(times) / 1e9


def bench_decode(
    config: ModelConfig,
    params: Params,
    policy: Policy,
    *,
    context: int,
    batch: int,
    steps: int,
    budget: int | None = None,
    cache_dtype=None,
    implementation: str = "xla",
    fill_chunk: int = 512,
    copy_bytes: int = 1 << 28,
    progress: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    scan_layers: bool = False,
) -> DecodeBench:
    """Time `steps` decode steps after filling the cache to `context` tokens (progress: a bar
    of the fill and a line per phase on stderr). With `mesh`, the same steps run sharded
    (`kvjax.sharding.TENSOR_PARALLEL`; the fill runs unsharded, then the cache is placed).
    With `scan_layers` the cache is stacked and every phase (fill, decode, the policy alone)
    runs the layers in one `lax.scan` (pass `stack_params(params)` to spare a copy per call).

    Raises:
        ValueError: context not a multiple of fill_chunk; `scan_layers` with a mesh or with
            a policy of per-layer budgets.
    """
    if context % fill_chunk:
        raise ValueError(f"context ({context}) must be a multiple of fill_chunk ({fill_chunk})")
    if scan_layers and mesh is not None:
        raise ValueError("bench_decode(scan_layers=True) does not run on a mesh yet")
    dtype = cache_dtype or jax.tree_util.tree_leaves(params)[0].dtype
    n = context + 4 * steps + 1
    cache = new_cache(config, policy, batch=batch, max_len=n, dtype=dtype, stacked=scan_layers)
    if scan_layers:
        params = stack_params(params, config)  # no copy when already stacked
    say = lambda msg: print(f"  [{policy.name}] {msg}", file=sys.stderr, flush=True)
    key = jax.random.key(0)
    t = time.perf_counter()
    cache, key = fill_random(policy, cache, context, fill_chunk, key, progress=progress)
    jax.block_until_ready(cache)
    fill_s = time.perf_counter() - t
    if progress:
        say(f"filled {context} tokens in {fill_s:.1f} s; compiling the decode loop")
    kv_live = int(live_bytes(cache).sum())
    kv_phys = physical_bytes(cache)
    tok = jnp.zeros((batch,), jnp.int32)
    step = lambda s: _decode(config, policy, steps, implementation, params, *s)
    sharded = {}
    if mesh is not None:
        from kvjax.eval._bench_mesh import sharded_step

        step, params, cache, tok, sharded = sharded_step(
            config, policy, steps, implementation, mesh, params, cache, tok
        )
        if progress:
            say(f"mesh {sharded['mesh']}: collectives per step {sharded['collectives_per_step']}")
    (cache, tok), (first_s, sec) = call_seconds(step, (cache, tok))
    sec /= steps
    if progress:
        say(f"decode loop: first call {first_s:.1f} s, then {sec * 1e3:.2f} ms/step")
        say("timing the policy's own write alone")
    peak = peak_device_bytes()  # before the policy-only loop: the model's decode peak
    cache, policy_sec = policy_seconds_per_step(policy, steps, cache, key)
    w_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    bw = copy_bandwidth(copy_bytes)
    return DecodeBench(
        model=config.name,
        policy=policy.name,
        budget=budget,
        batch=batch,
        context=context,
        steps=steps,
        dtype=str(np.dtype(dtype)),
        device=jax.devices()[0].device_kind,
        ms_per_step=sec * 1e3,
        tokens_per_s=batch / sec,
        weight_bytes=int(w_bytes),
        live_kv_bytes=kv_live,
        physical_kv_bytes=kv_phys,
        floor_ms=(w_bytes + kv_live) / (bw * 1e9) * 1e3,
        copy_gbps=bw,
        achieved_gbps=(w_bytes + kv_live) / sec / 1e9,
        policy_ms_per_step=policy_sec * 1e3,
        peak_device_bytes=peak,
        fill_s=fill_s,
        first_call_s=first_s,
        scan_layers=scan_layers,
        tuning=tuning_overrides(),
        **sharded,
    )
