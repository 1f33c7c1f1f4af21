"""Random cache tiers for the decode-kernel tests and a float64 NumPy oracle of the attention."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kvjax import quant
from kvjax.pallas_kernels.decode_attention import FullTier, Int8Tier, LowBitTier

PAGE = 16  # tokens per low-bit page in the tests
VALUE_GROUP = 32


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel test: dtype, tiers, GQA ratio, head dim, capacities (not block multiples)."""

    dtype: str
    tiers: str  # "fp", "fp+int8", "fp+int2", "fp+int4", "fp+int8b" (8-bit pages)
    ratio: int
    head_dim: int
    cap: int = 45
    batch: int = 2
    kv_heads: int = 2

    @property
    def bits(self) -> int | None:
        return {"fp+int2": 2, "fp+int4": 4, "fp+int8b": 8}.get(self.tiers)


def _positions(rng, b, h, n, q_pos):
    """Distinct positions < q_pos with holes (-1) in the middle and an empty tail on one head."""
    pos = np.stack([rng.permutation(q_pos)[:n] for _ in range(b * h)]).reshape(b, h, n)
    pos = pos.astype(np.int32)
    pos[:, :, n // 3 : n // 3 + 3] = -1  # holes in the middle
    pos[0, -1, n - n // 4 :] = -1  # a shorter head: its extent stops early
    return pos


def _extent(pos: np.ndarray) -> np.ndarray:
    n = pos.shape[-1]
    return np.where(pos >= 0, np.arange(1, n + 1), 0).max(-1).astype(np.int32)


def make_tiers(case: Case, seed: int, page: int = PAGE, value_group: int = VALUE_GROUP):
    """(q [B, Hkv, G, D], q_pos [B], FullTier, Int8Tier|None, LowBitTier|None) from fresh noise."""
    rng = np.random.default_rng(seed)
    b, h, g, d, n = case.batch, case.kv_heads, case.ratio, case.head_dim, case.cap
    dt = jnp.dtype(case.dtype)
    pages = max(3, n // page)
    span = max(300, 2 * max(n, pages * page))  # positions are drawn from range(span)
    q_pos = np.array([span + 100, span // 2][:b], np.int32)  # sequence 1: half in its future
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)
    q = jnp.asarray(2 * normal(b, h, g, d), dt)  # sharper softmax than unit logits
    pos = _positions(rng, b, h, n, span)
    full = FullTier(
        jnp.asarray(normal(b, h, n, d), dt),
        jnp.asarray(normal(b, h, n, d), dt),
        jnp.asarray(pos),
        jnp.asarray(_extent(pos)),
    )
    int8 = lowbit = None
    if case.tiers == "fp+int8":
        m = n - 7
        kc, ks = quant.quantize_int8(jnp.asarray(normal(b, h, m, d)))
        vc, vs = quant.quantize_int8(jnp.asarray(normal(b, h, m, d)))
        p8 = _positions(rng, b, h, m, span)
        int8 = Int8Tier(kc, vc, ks, vs, jnp.asarray(p8), jnp.asarray(_extent(p8)))
    if case.bits:
        kc, kscale, kzero = quant.quantize_per_channel(
            jnp.asarray(normal(b, h, pages, page, d)), case.bits
        )
        vc, vscale, vzero = quant.quantize_per_token(
            jnp.asarray(normal(b, h, pages, page, d)), case.bits, min(value_group, d)
        )
        pl_ = _positions(rng, b, h, pages * page, span).reshape(b, h, pages, page)
        pl_[1, 0, 1] = -1  # a dormant page in the middle
        extent = (pl_ >= 0).any(-1)
        extent = np.where(extent, np.arange(1, pages + 1), 0).max(-1).astype(np.int32)
        lowbit = LowBitTier(
            quant.pack(kc, case.bits),
            quant.pack(vc, case.bits),
            kscale,
            kzero,
            vscale,
            vzero,
            jnp.asarray(pl_),
            jnp.asarray(extent),
        )
    return q, jnp.asarray(q_pos), full, int8, lowbit


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def oracle(q, q_pos, full, int8, lowbit, bits, scale):
    """float64 attention: (out [B, Hkv, G, D], lse [B, Hkv, G], logits per tier, visible)."""
    qpos = np.asarray(q_pos)[:, None, None]
    segs = [(_f64(full.k), _f64(full.v), np.asarray(full.pos), np.asarray(full.extent))]
    if int8 is not None:
        k = _f64(int8.k) * _f64(int8.k_scale)[..., None]
        v = _f64(int8.v) * _f64(int8.v_scale)[..., None]
        segs.append((k, v, np.asarray(int8.pos), np.asarray(int8.extent)))
    if lowbit is not None:
        b, h, p, tp, _ = lowbit.k.shape
        kc = _f64(quant.unpack(lowbit.k, bits))
        vc = _f64(quant.unpack(lowbit.v, bits))
        k = kc * _f64(lowbit.k_scale)[:, :, :, None] + _f64(lowbit.k_zero)[:, :, :, None]
        ng = lowbit.v_scale.shape[-1]
        vg = vc.reshape(*vc.shape[:-1], ng, -1)
        v = (vg * _f64(lowbit.v_scale)[..., None] + _f64(lowbit.v_zero)[..., None]).reshape(
            vc.shape
        )
        pos = np.asarray(lowbit.pos).copy()
        pos[np.arange(p)[None, None, :] >= np.asarray(lowbit.extent)[..., None]] = -1
        flat = lambda x: x.reshape(b, h, p * tp, *x.shape[4:])
        segs.append((flat(k), flat(v), flat(pos), np.full((b, h), p * tp)))
    qf = _f64(q)
    logits, seen_all, values = [], [], []
    for k, v, pos, ext in segs:
        seen = (pos >= 0) & (pos <= qpos) & (np.arange(pos.shape[-1]) < ext[..., None])
        s = np.einsum("bhgd,bhnd->bhgn", qf, k) * scale
        logits.append(np.where(seen[:, :, None], s, -np.inf))
        seen_all.append(seen)
        values.append(v)
    s = np.concatenate(logits, -1)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    den = p.sum(-1)
    out = np.einsum("bhgn,bhnd->bhgd", p, np.concatenate(values, 2)) / den[..., None]
    return out, m[..., 0] + np.log(den), logits, seen_all


def stack_layers(tiers):
    """The tiers' slot arrays stacked along a new leading [L] axis (a layer stack, `layer=`);
    the extent stays the first tier's, one layer's [B, Hkv]."""
    first = tiers[0]
    stack = lambda f: (
        getattr(first, f) if f == "extent" else jnp.stack([getattr(t, f) for t in tiers])
    )
    return type(first)(**{f: stack(f) for f in first._fields})
