"""Decode-attention kernel benchmark: ours at BF16/INT8/INT4/INT2 vs cuDNN, XLA and XLA
dequantize-then-attend, on the same shapes, in µs and achieved TB/s of the bytes each reads.

Every row is timed the same way: `iters` attention calls inside one jitted `fori_loop` (each
call's query depends on the previous output, so none is hoisted), median of `repeats` runs.
`unroll` calls per loop iteration (`fori_loop(unroll=)`) take the loop's own per-iteration cost
(on a GPU, the host's test of the loop condition and its launch gap) off all but one call in
`unroll`: at small shapes (batch 1) that cost is a large part of a call.
Bytes read are the arrays each implementation must read once: K/V (codes), their scales and
zeros, and (ours) the per-slot positions. The `copy` row is the ceiling: a device copy of the
BF16 K/V bytes, its TB/s counting bytes read + written (so 2× bytes_read over its µs).
The `pallas-bf16-pooled` rows hold the same tokens as `pallas-bf16` in one slot pool per
sequence shared by the KV heads (adakv's layout), each head's slots shuffled through the pool;
they read its K/V once plus a position and an owner id per slot.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.eval._bench import copy_bandwidth
from kvjax.pallas_kernels import decode_attention as da
from kvjax.quant import pack, quantize_int8, quantize_per_channel, quantize_per_token

# Calls per timed loop. Each loop also pays a fixed cost (dispatching the jitted loop, waiting
# for it): about 0.38 ms on an H100, which at 20 calls added 17 µs to each call of a B = 1 row
# (docs/lab/2026-12-06-h100-timing-loop.md); at 200, under 2 µs.
ITERS = 200

ROWS = (
    "copy", "cudnn-bf16", "xla-bf16", "xla-dequant-int8",
    "pallas-bf16", "pallas-bf16-fc", "pallas-bf16+logits", "pallas-bf16-pooled",
    "pallas-bf16-pooled+logits",
    "pallas-int8", "pallas-int8-fc", "pallas-int4", "pallas-int2",
    "pallas-int4-f32stats", "pallas-int2-f32stats", "pallas-int4+logits", "pallas-int2+logits",
    "mgpu-bf16", "mgpu-bf16+logits", "mgpu-int8", "mgpu-int4", "mgpu-int2",
    "mgpu-int4-codes", "mgpu-int4-codes-wgmma", "mgpu-int4-codes-auto",
    "mgpu-int2-codes", "mgpu-int2-codes-wgmma", "mgpu-int2-codes-auto",
    "mgpu-int4-codes-auto+logits", "mgpu-int2-codes-auto+logits",
    "mgpu-int4-words", "mgpu-int2-words", "mgpu-int4-words+logits", "mgpu-int2-words+logits",
    "mgpu-tm-bf16", "mgpu-tm-bf16+logits", "pallas-bf16-join", "mgpu-tm-bf16-join",
    "pallas-int8+logits", "mgpu-tm-int8", "mgpu-tm-int8+logits", "mgpu-tm-int8-join",
    "mgpu-pages-int4", "mgpu-pages-int2", "mgpu-pages-int4+logits", "mgpu-pages-int2+logits",
)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelBench:
    """One timed row (JSON-ready via dataclasses.asdict); `error` set when it could not run."""

    row: str
    knobs: str
    batch: int
    context: int
    q_heads: int
    kv_heads: int
    head_dim: int
    device: str
    us: float | None = None
    bytes_read: int = 0
    tbps: float | None = None
    build_s: float | None = None  # building the row's arrays (random K/V, quantizing) this time
    first_s: float | None = None  # the first timed loop: tracing, compiling, `iters` calls
    unroll: int = 1  # calls per iteration of the timed loop
    iters: int = ITERS  # calls per timed loop
    error: str | None = None
    tuning: str = ""  # the KVJAX_TUNING overrides of the decode kernels' Tuning ("" = none)


def _int8_row(row: str) -> bool:
    return row in ("pallas-int8", "pallas-int8-fc", "pallas-int8+logits")


def _lowbit_row(row: str) -> bool:
    return row.startswith(("pallas-int4", "pallas-int2"))


def _mgpu_row(row: str) -> bool:
    return row.startswith("mgpu-")


def _mgpu_lowbit_row(row: str) -> bool:
    return row.startswith(("mgpu-int4", "mgpu-int2"))


_MGPU_LOWBIT = (_mgpu_lowbit_row, "Mosaic GPU low-bit")
# Knobs that only some rows take: knob -> (does this row take it, which rows, in words).
_ROW_KNOBS = {
    "int8_qk": (lambda r: _int8_row(r) or _lowbit_row(r), "INT8 and low-bit"),
    "v_words": (_int8_row, "INT8"),
    "stack_pages": (_lowbit_row, "low-bit"),
    "asm_unpack": (_lowbit_row, "low-bit"),
    "tokens_m": (_lowbit_row, "low-bit"),
    "stages": (_mgpu_row, "Mosaic GPU"),
    "pages_per_step": _MGPU_LOWBIT,
    "fold_keys": _MGPU_LOWBIT,
    "int4_offset": (lambda r: r.startswith("mgpu-int") and "-codes" in r, "Mosaic GPU int4-code"),
    "one_barrier": _MGPU_LOWBIT,
    "overlap": _MGPU_LOWBIT,
    "bias_outside": _MGPU_LOWBIT,
    "words_lop3": (lambda r: r.startswith("mgpu-int") and "-words" in r, "Mosaic GPU words"),
    "tc_bias": _MGPU_LOWBIT,
    "qk_split": _MGPU_LOWBIT,
    "subnormal": (lambda r: r.startswith("mgpu-int") and "-words" in r, "Mosaic GPU words"),
    "lean_barriers": _MGPU_LOWBIT,
}
# Every knob `bench_kernel`'s sweep takes: the launch knobs of all our rows, then those above.
SWEEP_KNOBS = ("block_k", "num_splits", "num_warps", "num_stages", *_ROW_KNOBS)


def _nbytes(*xs) -> int:
    return int(sum(x.size * jax.dtypes.itemsize_bits(x.dtype) for x in xs)) // 8


def _loop(fn: Callable, iters: int, unroll: int = 1) -> Callable:
    """jit(q, data) -> q after `iters` chained calls q <- q + 1e-3·fn(q, data), `unroll` of
    them an iteration of one `fori_loop`.

    The cache arrays `data` are arguments of the jitted loop: closed over, they would be
    embedded in the program as constants (minutes of compiling at S = 32K)."""

    @jax.jit
    def loop(q, data):
        def body(_, q):
            out = fn(q, data).astype(q.dtype)
            return q + out * jnp.asarray(1e-3, q.dtype)

        return jax.lax.fori_loop(0, iters, body, q, unroll=unroll)

    return loop


def _timed(
    fn: Callable, q: jax.Array, data, iters: int, repeats: int, unroll: int = 1
) -> tuple[float, float]:
    """(median seconds per call of fn(q, data) -> out [B, Hq, D], seconds of the first run of
    the loop: tracing, compiling and `iters` calls; `unroll` of them a loop iteration)."""
    loop = _loop(fn, iters, unroll)
    t = time.perf_counter()
    jax.block_until_ready(loop(q, data))
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(loop(q, data))
        times.append((time.perf_counter() - t) / iters)
    return float(np.median(times)), first


def _cases(b: int, s: int, hq: int, hkv: int, d: int, page: int, value_group: int, key):
    """name -> thunk() -> (fn(q [B, Hq, D], knobs, data) -> [B, Hq, D], data, bytes read) for
    every row; data is the pytree of cache arrays the row reads (passed to the timed loop as an
    argument).

    Lazy: a row's arrays (quantized codes, the shuffled pool, ...) are built the first time a
    row needs them and shared with the rows after it, so a run of a few rows builds only theirs.
    """
    g = hq // hkv
    scale = d**-0.5
    ks = jax.random.split(key, 3)
    memo: dict[str, object] = {}

    def once(name: str, build: Callable):
        if name not in memo:
            memo[name] = build()
        return memo[name]

    def kv():
        return once("kv", lambda: (
            jax.random.normal(ks[0], (b, hkv, s, d), jnp.bfloat16),
            jax.random.normal(ks[1], (b, hkv, s, d), jnp.bfloat16),
        ))  # fmt: skip

    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, hkv, s))
    extent = jnp.full((b, hkv), s, jnp.int32)
    q_pos = jnp.full((b,), s, jnp.int32)
    grouped = lambda q: q.reshape(b, hkv, g, d)
    out = lambda o: o.reshape(b, hq, d)

    def kvt():  # [B, S, Hkv, D] for jax.nn
        return once("kvt", lambda: tuple(jnp.swapaxes(x, 1, 2) for x in kv()))

    def int8():
        def build():
            k, v = kv()
            return (*quantize_int8(k), *quantize_int8(v))  # k8, k8s, v8, v8s

        return once("int8", build)

    def nn_attn(impl):
        def fn(q, knobs, data):
            kk, vv = data
            return jax.nn.dot_product_attention(
                q[:, None], kk, vv, scale=scale, implementation=impl
            )[:, 0]

        return lambda: (fn, kvt(), _nbytes(*kv()))

    def dequant_then_attend(q, knobs, data):
        k8, k8s, v8, v8s = data
        kd = (k8.astype(jnp.float32) * k8s[..., None]).astype(jnp.bfloat16)
        vd = (v8.astype(jnp.float32) * v8s[..., None]).astype(jnp.bfloat16)
        kk, vv = jnp.swapaxes(kd, 1, 2), jnp.swapaxes(vd, 1, 2)
        return jax.nn.dot_product_attention(q[:, None], kk, vv, scale=scale)[:, 0]

    # a decode step's own key and value (the `-join` rows merge them with the partials)
    new_kv = jax.random.normal(ks[2], (2, b, hkv, d), jnp.bfloat16)

    def ours(logits=False, bits=None, mgpu=False, tm=False, join=False, fused=False, pages=False):
        def fn(q, knobs, tier):
            knobs = knobs or {}
            if pages:  # 8-token pages, tokens on the wgmma M axis (Mosaic GPU)
                p = da.decode_attention_pages_mgpu(
                    grouped(q), tier, q_pos, bits=bits, scale=scale, return_logits=logits,
                    **knobs,
                )  # fmt: skip
            elif tm:  # slots on the wgmma M axis
                p = da.decode_attention_mgpu_tm(
                    grouped(q), tier, q_pos, scale=scale, return_logits=logits, **knobs
                )
            elif isinstance(tier, da.PooledTier):
                p = da.decode_attention_pooled_triton(
                    grouped(q), tier, q_pos, scale=scale, return_logits=logits, **knobs
                )
            elif mgpu:
                p = da.decode_attention_mgpu(
                    grouped(q), tier, q_pos, scale=scale, return_logits=logits, **knobs
                )
            elif bits is None and fused:  # the split combine as one kernel (`decode_attention`)
                p = da.decode_attention_triton(
                    grouped(q), tier, q_pos, scale=scale, return_logits=logits, padded=True,
                    **knobs,
                )  # fmt: skip
                return out(da.combine_triton(p.out, p.lse, g)[0])
            elif bits is None:  # (the join reads the padded rows in place)
                p = da.decode_attention_triton(
                    grouped(q), tier, q_pos, scale=scale, return_logits=logits, padded=join,
                    **knobs,
                )  # fmt: skip
            else:
                p = da.decode_attention_lowbit_triton(
                    grouped(q), tier, q_pos, bits=bits, scale=scale, return_logits=logits,
                    **knobs,
                )  # fmt: skip
            if join:  # the partials and a new token in one launch, as a decode step merges them
                valid = jnp.ones((b,), bool)
                o, _, _ = da.join_new_token([p], grouped(q), *new_kv, valid, scale=scale)
                return out(o)
            return out(da.combine([p])[0])

        return fn

    def full(**kw):
        return lambda: (ours(**kw), da.FullTier(*kv(), pos, extent), _nbytes(*kv(), pos))

    def int8_tier(**kw):
        def case():
            k8, k8s, v8, v8s = int8()
            tier = da.Int8Tier(k8, v8, k8s, v8s, pos, extent)
            return ours(**kw), tier, _nbytes(*int8(), pos)

        return case

    def pooled(**kw):
        # The same tokens in one pool a sequence: slot order shuffled, so heads interleave.
        def build():
            k, v = kv()
            perm = jax.random.permutation(ks[2], hkv * s)
            pool = lambda x: x.reshape(b, 1, hkv * s, *x.shape[3:])[:, :, perm]
            heads = jnp.broadcast_to(jnp.arange(hkv, dtype=jnp.int32)[:, None], (b, hkv, s))
            n = jnp.full((b, 1), hkv * s, jnp.int32)
            tier = da.PooledTier(pool(k), pool(v), pool(pos), pool(heads), n)
            return tier, _nbytes(k, v, pos, heads)

        return lambda: (ours(**kw), *once("pool", build))

    def lowbit(bits: int, f32stats: bool, logits: bool = False, pages: bool = False):
        def build():
            k, v = kv()
            pages = s // page
            paged = lambda x: x.reshape(b, hkv, pages, page, d).astype(jnp.float32)
            kc, kscale, kzero = quantize_per_channel(paged(k), bits)
            vc, vscale, vzero = quantize_per_token(paged(v), bits, value_group)
            lpos = pos.reshape(b, hkv, pages, page)
            return (pack(kc, bits), pack(vc, bits), kscale, kzero, vscale, vzero, lpos), pages

        arrays, pages = once(f"int{bits}", build)
        if f32stats:  # the same codes and statistics held as float32: the layout before 2026-12-01
            arrays = arrays[:2] + tuple(x.astype(jnp.float32) for x in arrays[2:6]) + arrays[6:]
        tier = da.LowBitTier(*arrays, jnp.full((b, hkv), pages, jnp.int32))
        return ours(bits=bits, logits=logits, pages=pages), tier, _nbytes(*arrays)

    def mgpu_lowbit(bits: int, native=False, load: str = "upcast2x", logits=False):
        # Its own layout whatever --page/--value-group say: 64-token pages, 64-channel value
        # groups, values channel-major (`to_channel_major`; `native`: int4 codes, or "words":
        # 32-bit words in the dots' register order).
        def build():
            k, v = kv()
            pages = s // da.MGPU_LOWBIT_PAGE
            paged = lambda x: x.reshape(b, hkv, pages, da.MGPU_LOWBIT_PAGE, d).astype(jnp.float32)
            kc, kscale, kzero = quantize_per_channel(paged(k), bits)
            vc, vscale, vzero = quantize_per_token(paged(v), bits, 64)
            lpos = pos.reshape(b, hkv, pages, da.MGPU_LOWBIT_PAGE)
            ext = jnp.full((b, hkv), pages, jnp.int32)
            tier = da.LowBitTier(pack(kc, bits), pack(vc, bits), kscale, kzero, vscale, vzero,
                                 lpos, ext)  # fmt: skip
            words = native == "words"
            return da.to_channel_major(tier, bits, native=native is True, words=words)

        def fn(q, knobs, tier):
            extra = {"int4_load": load} if native is True else {}
            p = da.decode_attention_lowbit_mgpu(
                grouped(q), tier, q_pos, bits=bits, scale=scale, return_logits=logits, **extra,
                **(knobs or {}),
            )  # fmt: skip
            return out(da.combine([p])[0])

        layout = {False: "", True: "-codes", "words": "-words"}[native]
        tier = once(f"mgpu-int{bits}{layout}", build)  # one per layout
        return fn, tier, _nbytes(*tier[:5])

    cases = {
        "copy": lambda: (None, kv(), _nbytes(*kv())),  # copy_bandwidth: bytes read + written
        "cudnn-bf16": nn_attn("cudnn"),
        "xla-bf16": nn_attn("xla"),
        "xla-dequant-int8": lambda: (dequant_then_attend, int8(), _nbytes(*int8())),
        "pallas-bf16": full(),
        "pallas-bf16-fc": full(fused=True),
        "pallas-bf16+logits": full(logits=True),
        "pallas-bf16-pooled": pooled(),
        "pallas-bf16-pooled+logits": pooled(logits=True),
        "pallas-int8": int8_tier(),
        "pallas-int8-fc": int8_tier(fused=True),
        "mgpu-bf16": full(mgpu=True),
        "mgpu-bf16+logits": full(logits=True, mgpu=True),
        "mgpu-int8": int8_tier(mgpu=True),
        "mgpu-tm-bf16": full(tm=True),
        "mgpu-tm-bf16+logits": full(logits=True, tm=True),
        "pallas-bf16-join": full(join=True),
        "mgpu-tm-bf16-join": full(tm=True, join=True),
        # the INT8 tier as a decode step of confkv reads it: with the per-slot logits
        "pallas-int8+logits": int8_tier(logits=True),
        "mgpu-tm-int8": int8_tier(tm=True),
        "mgpu-tm-int8+logits": int8_tier(logits=True, tm=True),
        "mgpu-tm-int8-join": int8_tier(tm=True, join=True),
    }
    for bits in (4, 2):
        cases[f"pallas-int{bits}"] = functools.partial(lowbit, bits, False)
        cases[f"pallas-int{bits}-f32stats"] = functools.partial(lowbit, bits, True)
        # with the per-slot logits, as QEvict's low-bit tier reads (its 8-token windows:
        # --page 8 --value-group 128)
        cases[f"pallas-int{bits}+logits"] = functools.partial(lowbit, bits, False, True)
        # the same tier read by the Mosaic GPU kernel of 8-token pages (--page 8
        # --value-group 128 --contexts a multiple of 128)
        cases[f"mgpu-pages-int{bits}"] = functools.partial(lowbit, bits, False, False, True)
        cases[f"mgpu-pages-int{bits}+logits"] = functools.partial(lowbit, bits, False, True, True)
        cases[f"mgpu-int{bits}"] = functools.partial(mgpu_lowbit, bits)
        # int4 arrays (`to_channel_major(native=True)`), each way of loading them (INT4_LOADS)
        for load, suffix in (("upcast2x", ""), ("wgmma", "-wgmma"), ("auto", "-auto")):
            cases[f"mgpu-int{bits}-codes{suffix}"] = functools.partial(
                mgpu_lowbit, bits, True, load
            )
        # with the per-slot logits (the policies that rank by attention mass)
        cases[f"mgpu-int{bits}-codes-auto+logits"] = functools.partial(
            mgpu_lowbit, bits, True, "auto", True
        )
        cases[f"mgpu-int{bits}-words"] = functools.partial(mgpu_lowbit, bits, "words")
        cases[f"mgpu-int{bits}-words+logits"] = functools.partial(
            mgpu_lowbit, bits, "words", logits=True
        )
    return cases


def bench_kernel(
    *,
    batch: int,
    context: int,
    q_heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    page: int = 32,
    value_group: int = 32,
    rows: tuple[str, ...] = ROWS,
    iters: int = ITERS,
    repeats: int = 5,
    unroll: int = 1,
    sweep: tuple[dict, ...] = (),
    sweep_rows: tuple[str, ...] = ("pallas-bf16",),
    on_row: Callable[[KernelBench], None] | None = None,
) -> list[KernelBench]:
    """Time every requested row on one shape; a row that fails records its error and goes on.

    Then every row of `sweep_rows` again for every knob setting in `sweep` (dicts of block_k,
    num_splits, num_warps, num_stages overriding the tuned defaults; v_words for the INT8 row
    only, int8_qk for the INT8 and low-bit rows, stack_pages, asm_unpack and tokens_m for the
    low-bit rows only), on the same data.
    `on_row` sees each row as soon as it is timed (progress). `unroll`: calls per iteration of
    the timed loop (a divisor of `iters`).
    """
    if unroll < 1 or iters % unroll:
        raise ValueError(f"unroll must be a positive divisor of iters={iters}, got {unroll}")
    for knob, (rows_of, label) in _ROW_KNOBS.items():
        wrong = [r for r in sweep_rows if not rows_of(r)]
        if wrong and any(knob in knobs for knobs in sweep):
            raise ValueError(f"sweep knob {knob} applies to the {label} rows only, not {wrong}")
    dev = jax.devices()[0].device_kind
    shape = dict(batch=batch, context=context, q_heads=q_heads, kv_heads=kv_heads)
    shape.update(head_dim=head_dim, device=dev, unroll=unroll, iters=iters)
    shape.update(tuning=da.tuning_overrides())
    key = jax.random.key(0)
    cases = _cases(batch, context, q_heads, kv_heads, head_dim, page, value_group, key)
    q = jax.random.normal(jax.random.key(1), (batch, q_heads, head_dim), jnp.bfloat16)
    runs = [(name, None) for name in rows]
    runs += [(name, k) for k in sweep for name in sweep_rows]
    results = []
    for name, knobs in runs:
        row = dict(row=name, knobs=json.dumps(knobs or {}, sort_keys=True))
        first = None
        t = time.perf_counter()
        try:
            fn, data, nbytes = cases[name]()
            jnp.zeros(()).block_until_ready()  # (one stream: after the arrays' ops)
            row.update(bytes_read=nbytes, build_s=time.perf_counter() - t)
            if name == "copy":  # the bandwidth ceiling: read + write the BF16 K/V bytes once
                moved = 2 * nbytes
                sec = moved / (copy_bandwidth(nbytes) * 1e9)
            else:
                moved = nbytes
                sec, first = _timed(
                    lambda q, data, fn=fn, knobs=knobs: fn(q, knobs, data),
                    q,
                    data,
                    iters,
                    repeats,
                    unroll,
                )
            res = KernelBench(us=sec * 1e6, tbps=moved / sec / 1e12, first_s=first, **row, **shape)
        except Exception as e:  # noqa: BLE001 - e.g. cuDNN missing on CPU: record, keep going
            res = KernelBench(error=f"{type(e).__name__}: {str(e)[:300]}", **row, **shape)
        results.append(res)
        if on_row is not None:
            on_row(res)
    return results
