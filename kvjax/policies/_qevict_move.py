"""QEvict's data movement at a routing event: quantize windows at their first demotion, bring
promoted windows back from their ledger, copy windows leaving the ring. Only the selected
candidates are read, so an event costs the bytes it moves (see `route`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.quant import (
    dequantize_per_channel,
    dequantize_per_token,
    pack,
    quantize_per_channel,
    quantize_per_token,
    unpack,
)

Array = jax.Array


def put(a: Array, idx: Array, x: Array) -> Array:
    """a[b, h, idx[b, h, n]] = x[b, h, n] (out-of-range idx dropped)."""
    b, h = idx.shape[:2]
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(h)[None, :, None]
    return a.at[bi, hi, idx].set(x.astype(a.dtype), mode="drop")


def move_windows(layer, lay, new_k, new_v, new_score, nwin, page_dst, fp_dst, sq, sf, all_pos):
    """Quantize the selected candidates `sq` [B, H, n] (indices into full-precision slots ‖ new
    windows) into their pages, and write the selected `sf` [B, H, m] (pages ‖ new windows) into
    their full-precision slots, dequantized from the ledger. Returns the low-bit tier with new
    codes and the layer's new k, v, pos (from `all_pos`) and score."""
    b, h = layer.pos.shape[:2]
    w, f, base, d = lay.window, lay.fp_windows, lay.fp_base, layer.k.shape[-1]
    kk = new_k.shape[2]
    lb = layer.lowbit
    tok = jnp.arange(w, dtype=jnp.int32).reshape(1, 1, 1, w)

    def pick(resident, new, idx, n_res):
        """Entry idx [B, H, n] of (resident ‖ new): resident is a function of indices in
        [0, n_res), new is [B, H, K, ...]."""
        nw = jnp.take_along_axis(new, _expand(jnp.clip(idx - n_res, 0, kk - 1), new), axis=2)
        if n_res == 0:
            return nw
        r = resident(jnp.clip(idx, 0, n_res - 1))
        return jnp.where(_expand(idx < n_res, r), r, nw.astype(r.dtype))

    def fp_window(a):
        def get(i):  # [B, H, n] window slots -> [B, H, n, ω, ...]
            t = (base + i[..., None] * w + tok).reshape(b, h, -1)
            out = jnp.take_along_axis(a, _expand(t, a), axis=2)
            return out.reshape(b, h, i.shape[-1], w, *a.shape[3:])

        return get

    # First demotions: quantize once, into the allocated page.
    src_k = pick(fp_window(layer.k), new_k, sq, f)
    src_v = pick(fp_window(layer.v), new_v, sq, f)
    dst = jnp.take_along_axis(page_dst, sq, axis=-1)
    kc, ks, kz = quantize_per_channel(src_k, lb.bits)
    vc, vs, vz = quantize_per_token(src_v, lb.bits, d // lb.v_scale.shape[-1])
    lb = lb.replace(
        k=put(lb.k, dst, pack(kc, lb.bits)),
        v=put(lb.v, dst, pack(vc, lb.bits)),
        k_scale=put(lb.k_scale, dst, ks),
        k_zero=put(lb.k_zero, dst, kz),
        v_scale=put(lb.v_scale, dst, vs),
        v_zero=put(lb.v_zero, dst, vz),
    )
    # Entering full precision: promoted pages dequantized from their ledger, or new windows.
    old = layer.lowbit
    npg = old.pos.shape[2]
    page = lambda a: lambda i: jnp.take_along_axis(a, _expand(i, a), axis=2)
    deq_k = lambda i: dequantize_per_channel(
        unpack(page(old.k)(i), old.bits), page(old.k_scale)(i), page(old.k_zero)(i), layer.k.dtype
    )
    deq_v = lambda i: dequantize_per_token(
        unpack(page(old.v)(i), old.bits), page(old.v_scale)(i), page(old.v_zero)(i), layer.v.dtype
    )
    in_k = pick(deq_k, new_k, sf, npg)
    in_v = pick(deq_v, new_v, sf, npg)
    first = (tok == 0).astype(jnp.float32)
    in_score = pick(lambda i: page(old.score)(i)[..., None] * first, new_score, sf, npg)
    new_pos = lay.sinks + nwin[..., None] * w + tok
    in_pos = pick(page(old.pos), new_pos, sf, npg)
    dst = jnp.take_along_axis(fp_dst, sf, axis=-1)
    slot = jnp.where(dst[..., None] < f, base + dst[..., None] * w + tok, layer.capacity)
    slot = slot.reshape(b, h, -1)  # [B, H, m·ω] token slots
    flat = lambda x: x.reshape(b, h, slot.shape[-1], *x.shape[4:])
    k = put(layer.k, slot, flat(in_k))
    v = put(layer.v, slot, flat(in_v))
    return lb, k, v, put(all_pos, slot, flat(in_pos)), put(layer.score, slot, flat(in_score))


def _expand(idx: Array, like: Array) -> Array:
    """idx [B, H, n] (or [B, H, n·ω]) reshaped to broadcast against `like` along axis 2."""
    extra = like.ndim - idx.ndim
    return idx.reshape(idx.shape + (1,) * extra) if extra > 0 else idx
