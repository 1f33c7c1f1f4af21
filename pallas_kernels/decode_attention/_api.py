"""`decode_attention`: every tier of a layer through its kernel, splits and tiers combined."""

from __future__ import annotations

import functools
import warnings
from typing import Literal, NamedTuple

import jax

from kvjax.pallas_kernels.decode_attention._combine import combine
from kvjax.pallas_kernels.decode_attention._tiers import (
    ChannelMajorLowBitTier,
    FullTier,
    Int8Tier,
    LowBitTier,
    Partials,
    PooledTier,
)
from kvjax.pallas_kernels.decode_attention._tuning import tuning_for

Array = jax.Array
Backend = Literal["triton", "mosaic", "tpu"]
BACKENDS: tuple[str, ...] = ("triton", "mosaic", "tpu")


class DecodeResult(NamedTuple):
    """Attributes:
    out: [B, Hkv, G, D] float32 attention over the tiers (0 where nothing was visible).
    lse: [B, Hkv, G] float32 log-sum-exp of the visible scaled logits (-inf if none).
    logits: per given tier (full, then int8, then lowbit) [B, Hkv, G, N] float32 scaled logits
        of every slot (arbitrary where not visible), or () without return_logits.
    """

    out: Array
    lse: Array
    logits: tuple[Array, ...]


def default_backend(platform: str | None = None) -> Backend | None:
    """The kernel backend of a platform ("gpu" → triton, "tpu" → tpu), None elsewhere."""
    platform = platform or jax.default_backend()
    return {"gpu": "triton", "cuda": "triton", "tpu": "tpu"}.get(platform)


def decode_attention(
    q: Array,
    q_pos: Array,
    *,
    full: FullTier | PooledTier,
    int8: Int8Tier | None = None,
    lowbit: LowBitTier | ChannelMajorLowBitTier | None = None,
    bits: int = 2,
    scale: float,
    backend: Backend = "triton",
    return_logits: bool = False,
    interpret: bool = False,
    block_k: int | None = None,
    num_splits: int | None = None,
    layer: Array | None = None,
) -> DecodeResult:
    """One decode query per sequence attending a layer's full, INT8 and low-bit tiers
    (`decode_partials`, then their log-sum-exp `combine`). A lone full tier on the Triton
    kernel is combined by one more kernel (`combine_triton`) where the device's
    Tuning.fused_combine says so, instead of XLA's several."""
    if _fused_combine(backend, full, int8, lowbit):
        from kvjax.pallas_kernels.decode_attention._combine_triton import (
            combine_applies,
            combine_triton,
        )
        from kvjax.pallas_kernels.decode_attention._triton import (
            decode_attention_triton,
            partials,
        )

        part = decode_attention_triton(
            q, full, q_pos, layer, scale=scale, block_k=block_k, num_splits=num_splits,
            return_logits=return_logits, interpret=interpret, padded=True,
        )  # fmt: skip
        group = q.shape[2]
        logits = (part.logits,) if return_logits else ()
        if combine_applies(part.out.shape[2], q.shape[3]) is None:
            out, lse = combine_triton(part.out, part.lse, group, interpret=interpret)
        else:  # the G real rows, combined by XLA
            out, lse = combine([partials((part.out, part.lse), group, False)])
        return DecodeResult(out, lse, logits)
    parts = decode_partials(
        q, q_pos, full=full, int8=int8, lowbit=lowbit, bits=bits, scale=scale, backend=backend,
        return_logits=return_logits, interpret=interpret, block_k=block_k,
        num_splits=num_splits, layer=layer,
    )  # fmt: skip
    out, lse = combine(parts)
    logits = tuple(p.logits for p in parts) if return_logits else ()
    return DecodeResult(out, lse, logits)


def decode_partials(
    q: Array,
    q_pos: Array,
    *,
    full: FullTier | PooledTier,
    int8: Int8Tier | None = None,
    lowbit: LowBitTier | ChannelMajorLowBitTier | None = None,
    bits: int = 2,
    scale: float,
    backend: Backend = "triton",
    return_logits: bool = False,
    interpret: bool = False,
    block_k: int | None = None,
    num_splits: int | None = None,
    layer: Array | None = None,
    padded: bool = False,
) -> list[Partials]:
    """Each tier's split partials (full, then INT8, then low-bit), not yet combined: what
    `decode_attention` combines, and what `join_new_token` merges with a step's own token.

    Each tier runs its own kernel (split-K over its live blocks); the partials are combined with
    a log-sum-exp. Args are as in `decode_attention_reference`, plus:

    Args:
        backend: "triton" (GPU: each dense tier runs the kernel its device's Tuning names in
            `mgpu_tiers`, the measured-faster one, where it applies; Triton otherwise),
            "mosaic" (GPU: the Mosaic GPU kernels wherever they apply, `mgpu_applies`; Triton
            for the rest and for the low-bit tier) or "tpu" (Mosaic TPU).
        return_logits: also return each tier's scaled logits (for the per-slot mass).
        interpret: run the kernels in the Pallas interpreter (CPU).
        block_k: slots per loop step of every tier's kernel (default: tuned per device and tier).
        num_splits: splits per (sequence, KV head) (default: fill the chip).
        layer: None, or an int32 scalar: the full and INT8 tiers' slot arrays are then stacks
            [L, B, Hkv, ...] read at this layer in place (`decode_attention_triton`'s `layer`;
            GPU backends only, dense tiers run by the Triton kernels); a low-bit tier whose
            arrays carry the same leading [L] axis (a token-major LowBitTier's k
            [L, B, Hkv, P, Tp, Dp], a ChannelMajorLowBitTier's) is read at it in place too, its
            extent the layer's; a per-layer low-bit tier is read as given. A token-major stack
            of 2-4 GiB of codes, which the Triton kernel cannot index (`overflowing_codes`), is
            read as the layer's slice (a copy of it).
        padded: the Triton dense kernels' out and lse keep their padded query rows
            [.., Gp >= G, ..] (the padding never written): for `join_new_token`, which reads
            the G real rows in place where a slice would be copied first. Other kernels' stay
            at G rows.

    A ChannelMajorLowBitTier as `lowbit` (`to_channel_major`) runs the Mosaic GPU low-bit kernel
    (`decode_attention_lowbit_mgpu`, GPU backends only; its logits as the others').

    A PooledTier as `full` (one slot pool shared by the KV heads) runs the pooled Triton kernel
    (`decode_attention_pooled_triton`; GPU backends only, no other tier): its logits are
    [B, Hkv, G, P], -inf on the slots other KV heads own.
    """
    if layer is not None and (backend not in ("triton", "mosaic") or isinstance(full, PooledTier)):
        raise ValueError(
            "decode attention: layer= (a stacked tier read in place) runs the GPU dense kernels "
            f"only, not backend {backend!r} or a PooledTier; slice the layer out instead"
        )
    if isinstance(lowbit, ChannelMajorLowBitTier) and backend not in ("triton", "mosaic"):
        raise ValueError(
            f"decode attention: a ChannelMajorLowBitTier runs on the GPU backends, not {backend!r}"
        )
    if isinstance(full, PooledTier):
        if backend not in ("triton", "mosaic"):
            raise ValueError(
                f"decode attention: a PooledTier runs on the GPU backends, not {backend!r}"
            )
        if int8 is not None or lowbit is not None:
            raise ValueError("decode attention: a PooledTier is the layer's only tier")
        from kvjax.pallas_kernels.decode_attention._triton_pooled import (
            decode_attention_pooled_triton,
        )

        part = decode_attention_pooled_triton(
            q, full, q_pos, scale=scale, block_k=block_k, num_splits=num_splits,
            return_logits=return_logits, interpret=interpret,
        )  # fmt: skip
        return [part]
    if backend in ("triton", "mosaic"):
        from kvjax.pallas_kernels.decode_attention._triton import decode_attention_triton as dense
        from kvjax.pallas_kernels.decode_attention._triton_lowbit import (
            decode_attention_lowbit_triton as packed,
        )
        from kvjax.pallas_kernels.decode_attention._triton_lowbit import overflowing_codes
    elif backend == "tpu":
        from kvjax.pallas_kernels.decode_attention._tpu import decode_attention_tpu as dense
        from kvjax.pallas_kernels.decode_attention._tpu_lowbit import (
            decode_attention_lowbit_tpu as packed,
        )
    else:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    # Each kernel entry point checks q, q_pos and its tier; only the tier's role is checked here.
    if int8 is not None and not isinstance(int8, Int8Tier):
        raise ValueError(f"decode attention: int8 must be an Int8Tier, got {type(int8).__name__}")
    knobs = dict(scale=scale, return_logits=return_logits, interpret=interpret)
    if backend != "tpu":
        dense = functools.partial(_gpu_dense, dense, backend=backend, padded=padded)
    tiling = dict(block_k=block_k, num_splits=num_splits)
    if layer is not None:  # a stacked dense tier
        tiling["layer"] = layer
    parts = [dense(q, full, q_pos, **tiling, **knobs)]
    if int8 is not None:
        parts.append(dense(q, int8, q_pos, **tiling, **knobs))
    mosaic_lowbit = None  # the Mosaic GPU low-bit kernel this tier runs, if one
    if isinstance(lowbit, ChannelMajorLowBitTier):  # checked above: a GPU backend
        from kvjax.pallas_kernels.decode_attention._mgpu_lowbit import (
            decode_attention_lowbit_mgpu as mosaic_lowbit,
        )
    elif lowbit is not None and backend != "tpu" and _pages_kernel(q, q_pos, lowbit, bits, layer):
        from kvjax.pallas_kernels.decode_attention._mgpu_pages import (
            decode_attention_pages_mgpu as mosaic_lowbit,
        )
    if mosaic_lowbit is not None:
        parts.append(
            mosaic_lowbit(
                q,
                lowbit,
                q_pos,
                bits=bits,
                scale=scale,
                num_splits=num_splits,
                return_logits=return_logits,
                interpret=interpret,
                layer=layer if lowbit.k.ndim == 6 else None,  # stacked: read in place
            )  # fmt: skip
        )
    elif lowbit is not None:
        # The TPU low-bit kernel blocks by whole pages (its own default); Triton's by tokens.
        paged = dict(block_k=block_k) if backend != "tpu" else {}
        if layer is not None and lowbit.k.ndim == 6:  # stacked (a GPU backend: checked above)
            if overflowing_codes(lowbit):  # the kernel cannot index this stack whole
                lowbit = _layer_of(lowbit, layer)
            else:
                paged["layer"] = layer  # read in place
        parts.append(packed(q, lowbit, q_pos, bits=bits, num_splits=num_splits, **paged, **knobs))
    return parts


def _pages_kernel(q: Array, q_pos: Array, tier: LowBitTier, bits: int, layer) -> bool:
    """Whether a GPU backend reads this token-major low-bit tier (one layer, or a stack at
    `layer`) through the Mosaic GPU kernel of 8-token pages (`decode_attention_pages_mgpu`):
    "pages" in the device Tuning's mgpu_tiers and the kernel applies (`pages_mgpu_applies`);
    q and the tier are checked first where the Tuning lists it."""
    if "pages" not in tuning_for().mgpu_tiers:
        return False
    from kvjax.pallas_kernels.decode_attention._mgpu_pages import pages_mgpu_applies
    from kvjax.pallas_kernels.decode_attention._validate import (
        check_lowbit,
        check_query,
        layer_view,
    )

    view = tier if layer is None or tier.k.ndim != 6 else layer_view(tier, layer)
    check_query(q, q_pos)
    check_lowbit(view, q, bits)
    return _applies("pages", pages_mgpu_applies(view, q, bits))


def _fused_combine(backend, full, int8, lowbit) -> bool:
    """Whether `decode_attention` runs a lone full tier through the Triton kernel and
    `combine_triton`: backend "triton", no other tier, a FullTier, and neither the Mosaic GPU
    kernels for it in the device's Tuning.mgpu_tiers nor Tuning.fused_combine off."""
    if backend != "triton" or int8 is not None or lowbit is not None:
        return False
    if type(full) is not FullTier:
        return False
    tune = tuning_for()
    return tune.fused_combine and not {"full", "full-tm"} & set(tune.mgpu_tiers)


def _layer_of(tier: LowBitTier, layer: Array) -> LowBitTier:
    """Layer `layer` sliced out of a stacked token-major tier (its extent is the layer's)."""
    from kvjax.pallas_kernels.decode_attention._validate import layer_view

    layer_view(tier, layer)  # the stack's own checks, with their messages
    take = lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)
    return tier._replace(**{f: take(a) for f, a in tier._asdict().items() if f != "extent"})


def slots_on_m(q: Array, tier, q_pos: Array, layer: Array | None = None) -> bool:
    """Whether `decode_partials` reads this dense tier (one layer, or a stack at `layer`) on
    the GPU through the slots-on-M Mosaic GPU kernel (`decode_attention_mgpu_tm`): its name
    ("full-tm" for a FullTier, "int8-tm" for an Int8Tier) in the device Tuning's mgpu_tiers,
    and the kernel applies (`mgpu_tm_applies`). Where the Tuning lists the tier's name, q
    and the tier are checked first (one clear error for bad input); else False at once."""
    from kvjax.pallas_kernels.decode_attention._validate import check_dense, check_query

    name = {FullTier: "full-tm", Int8Tier: "int8-tm"}.get(type(tier))
    if name is None or name not in tuning_for().mgpu_tiers:
        return False
    from kvjax.pallas_kernels.decode_attention import _mgpu_tm
    from kvjax.pallas_kernels.decode_attention._validate import layer_view

    view = tier if layer is None else layer_view(tier, layer)
    check_query(q, q_pos)
    check_dense(view, q)
    return _applies(name, _mgpu_tm.mgpu_tm_applies(view, q))


class KernelFallbackWarning(UserWarning):
    """A kernel the device's Tuning.mgpu_tiers names does not apply to a tier; the dispatch
    runs the Triton kernel instead (the message names the tier kind and why)."""


def _warn_fallback(name: str, why: str, stacklevel: int = 1) -> None:
    """Warn that the Mosaic GPU kernel `name` of the Tuning's mgpu_tiers does not apply to
    this tier (`why`) and Triton runs instead: once per reason and place, as Python's warnings
    do, so an A/B run with `KVJAX_TUNING=mgpu_tiers=...` cannot time Triton unawares.
    The warning's place is this function's caller (`stacklevel` 1) or a frame above it."""
    warnings.warn(
        f"decode attention: Tuning.mgpu_tiers names {name!r}, which does not apply to "
        f"this tier ({why}); it runs the Triton kernel",
        KernelFallbackWarning,
        stacklevel=stacklevel + 1,
    )


def _applies(name: str, why: str | None) -> bool:
    """Whether the Mosaic GPU kernel `name` of the Tuning's mgpu_tiers applies (`why` None);
    else `_warn_fallback` and False."""
    if why is not None:
        _warn_fallback(name, why, stacklevel=2)  # (the place: `_applies`' caller)
    return why is None


def _gpu_dense(triton_fn, q, tier, q_pos, *, backend: str, block_k, layer=None, padded=False, **kw):
    """A dense tier on the GPU: the Mosaic GPU kernel where `backend` (or, for "triton", the
    device's Tuning.mgpu_tiers) asks for it and it applies to the tier, else Triton (always
    for a stacked tier, `layer`). "full-tm" / "int8-tm" in the Tuning's mgpu_tiers runs a
    bfloat16 full tier / an INT8 tier, one layer or a stack read in place, through the
    slots-on-M kernel (`decode_attention_mgpu_tm`) first (`slots_on_m`)."""
    from kvjax.pallas_kernels.decode_attention import _mgpu
    from kvjax.pallas_kernels.decode_attention._validate import check_dense, check_query

    if slots_on_m(q, tier, q_pos, layer):
        from kvjax.pallas_kernels.decode_attention import _mgpu_tm

        return _mgpu_tm.decode_attention_mgpu_tm(q, tier, q_pos, layer=layer, **kw)
    tune = tuning_for()
    name = "int8" if isinstance(tier, Int8Tier) else "full"
    named = name in tune.mgpu_tiers
    if layer is not None:
        if named:
            _warn_fallback(
                name, "a stacked tier read in place: the dense Mosaic GPU kernel reads one layer"
            )
        return triton_fn(q, tier, q_pos, layer, block_k=block_k, padded=padded, **kw)
    check_query(q, q_pos)
    check_dense(tier, q)
    if backend == "mosaic" or named:
        why = _mgpu.mgpu_applies(tier, q, block_k or tune.mgpu_block_k)
        if why is None:
            return _mgpu.decode_attention_mgpu(q, tier, q_pos, block_k=block_k, **kw)
        if named:  # backend "mosaic" alone takes Triton where the kernel does not apply
            _warn_fallback(name, why)
    return triton_fn(q, tier, q_pos, block_k=block_k, padded=padded, **kw)
