"""KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"): no
eviction; the most recent tokens stay in full precision (the residual) and every full group of
G older tokens is quantized once to 2 bits, keys per channel over the group, values per token.

The residual holds the tokens since the last multiple of `residual` (between 0 and R−1 tokens);
when it fills, its R tokens are quantized as R/G pages and it empties.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax.numpy as jnp

from kvjax.cache import CacheSpec
from kvjax.policies._base import Policy
from kvjax.policies._lowbit_layout import check_layout, lowbit_layout
from kvjax.quant import BITS


@dataclasses.dataclass(frozen=True, kw_only=True)
class KIVIPolicy(Policy):
    """Full-precision residual + write-once low-bit pages; memory grows with length.

    Attributes:
        residual: R, recent tokens in full precision before a flush (multiple of group).
        group: G, tokens per key-quantization group (one page).
        bits: code width (2 by default; 4 and 8 allowed).
        value_group: channels sharing one value scale/zero.
        lowbit_layout: the pages' layout in the cache (`CacheSpec.lowbit_layout`): "token",
            "kernel" (the Mosaic GPU low-bit kernel's own: 64-token pages, 2 or 4 bits),
            "words" (the same kernel's codes in its dot registers' order: 64-token pages, 2 or
            4 bits, head_dim·bits a multiple of 256) or "auto", the default: the device
            Tuning's choice where the shapes allow (Hopper: "words" for bfloat16 caches at
            those shapes, "kernel" where only that fits), else "token".
    """

    uses_attention_mass: ClassVar[bool] = False

    name = "kivi"
    residual: int = 128
    group: int = 32
    bits: int = 2
    value_group: int = 32
    lowbit_layout: str = "auto"

    def __post_init__(self) -> None:
        if self.group < 1 or self.residual < self.group or self.residual % self.group:
            raise ValueError(
                f"KIVIPolicy.residual ({self.residual}) must be a positive multiple "
                f"of group ({self.group})"
            )
        check_layout("KIVIPolicy", self.lowbit_layout)
        if self.bits not in BITS:
            raise ValueError(f"KIVIPolicy.bits must be one of {BITS}, got {self.bits}")

    def capacity(self, max_len: int) -> int:
        del max_len
        return self.residual

    def cache_spec(self, *, batch, num_layers, num_kv_heads, head_dim, max_len, dtype):
        return CacheSpec(
            batch=batch,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            capacities=(self.residual,) * num_layers,
            dtype=dtype,
            lowbit_pages=(math.ceil(max_len / self.group) + 1,) * num_layers,
            lowbit_page_size=self.group,
            lowbit_bits=self.bits,
            lowbit_value_group=min(self.value_group, head_dim),
            lowbit_layout=lowbit_layout(
                self.lowbit_layout,
                page=self.group,
                head_dim=head_dim,
                bits=self.bits,
                value_group=min(self.value_group, head_dim),
                dtype=dtype,
            ),
        )

    def write(self, layer, k_new, v_new, pos_new, valid, stats, state, *, layer_index):
        del stats, state, layer_index
        if k_new.shape[1] == 1:
            return self._decode(layer, k_new, v_new, pos_new, valid)
        r, g = self.residual, self.group
        b, t, h, d = k_new.shape
        n0 = pos_new[:, 0]  # tokens before this call
        n1 = n0 + jnp.sum(valid, axis=1, dtype=jnp.int32)
        f0, f1 = (n0 // r) * r, (n1 // r) * r  # residual starts (pages hold [0, f))
        c0 = n0 - f0  # tokens in the residual now (slots 0..c0-1, in position order)
        # The token stream from f0 on: residual, then the new tokens, contiguous in position.
        i = jnp.arange(r + t, dtype=jnp.int32)[None, :]
        src = jnp.where(i < c0[:, None], i, r + i - c0[:, None])  # [B, R+T]
        take = lambda a, x: jnp.take_along_axis(
            jnp.concatenate([a, x], axis=2), jnp.clip(src, 0, r + t - 1)[:, None, :, None], axis=2
        )
        ks = take(layer.k, jnp.swapaxes(k_new, 1, 2).astype(layer.k.dtype))  # [B, H, R+T, D]
        vs = take(layer.v, jnp.swapaxes(v_new, 1, 2).astype(layer.v.dtype))
        # Full pages of the stream below f1 are quantized (once) and written.
        n_pages = (r + t) // g
        if n_pages:
            j = jnp.arange(n_pages, dtype=jnp.int32)[None, :]
            ok = (j + 1) * g <= (f1 - f0)[:, None]
            layer = self._write_pages(layer, ks, vs, f0, ok)
        # The residual becomes the stream's tail from f1 on.
        s = jnp.arange(r, dtype=jnp.int32)[None, :]
        tail = (f1 - f0)[:, None] + s  # [B, R] stream index of each residual slot
        keep = f1[:, None] + s < n1[:, None]
        pick = lambda x: jnp.take_along_axis(
            x, jnp.clip(tail, 0, r + t - 1)[:, None, :, None], axis=2
        )
        pos = jnp.broadcast_to(jnp.where(keep, f1[:, None] + s, -1)[:, None, :], (b, h, r))
        return layer.replace(
            k=pick(ks), v=pick(vs), pos=pos.astype(jnp.int32), score=jnp.zeros_like(layer.score)
        )

    def _decode(self, layer, k_new, v_new, pos_new, valid):
        """One token per sequence, in place: the token goes to its residual slot (one scatter,
        no rebuild of the residual); when that fills the residual, its R/G pages are quantized
        and written and its slots emptied (pos −1; K/V stay as dead slots the next tokens
        overwrite). Same cache as `write`'s general path on every live slot and page."""
        r = self.residual
        b, _, h, _ = k_new.shape
        n0 = pos_new[:, 0]
        f0 = (n0 // r) * r
        c0 = n0 - f0  # the token's residual slot
        slot = jnp.where(valid[:, 0], c0, r)[:, None]  # r: dropped (padding row)
        bi, hi = jnp.arange(b)[:, None], jnp.arange(h)[None, :]
        put = lambda a, x: a.at[bi, hi, slot].set(x.astype(a.dtype), mode="drop")
        k = put(layer.k, k_new[:, 0])
        v = put(layer.v, v_new[:, 0])
        pos = put(layer.pos, jnp.broadcast_to(n0[:, None], (b, h)))
        full = valid[:, 0] & (c0 == r - 1)  # the residual now holds R tokens: flush it
        ok = jnp.broadcast_to(full[:, None], (b, r // self.group))
        layer = self._write_pages(layer.replace(k=k, v=v), k, v, f0, ok)
        return layer.replace(pos=jnp.where(full[:, None, None], -1, pos))

    def _write_pages(self, layer, ks, vs, f0, ok):
        """Quantize the stream [B, H, ≥ P'·G, D] (tokens from position f0 [B]) as P' pages and
        write page j where ok [B, P'] (pages are write-once: the others are dropped)."""
        g = self.group
        lb = layer.lowbit
        b, h, _, d = ks.shape
        n_pages = ok.shape[1]
        pk = ks[:, :, : n_pages * g].reshape(b, h, n_pages, g, d)
        pv = vs[:, :, : n_pages * g].reshape(b, h, n_pages, g, d)
        j = jnp.arange(n_pages, dtype=jnp.int32)[None, :]
        page = jnp.where(ok, f0[:, None] // g + j, lb.pos.shape[2])[:, None, :]  # [B, 1, P']
        page = jnp.broadcast_to(page, (b, h, n_pages))
        tok_pos = f0[:, None, None, None] + (
            j[:, None, :, None] * g + jnp.arange(g)[None, None, None, :]
        )
        bi = jnp.arange(b)[:, None, None]
        hi = jnp.arange(h)[None, :, None]
        put = lambda a, x: a.at[bi, hi, page].set(x.astype(a.dtype), mode="drop")
        lb = lb.write(page, pk, pv).replace(
            pos=put(lb.pos, jnp.broadcast_to(tok_pos, (b, h, n_pages, g))),
            held=put(lb.held, jnp.ones((b, h, n_pages), bool)),
        )
        return layer.replace(lowbit=lb)
