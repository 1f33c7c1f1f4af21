"""Which layout a policy's low-bit pages take in the cache (`CacheSpec.lowbit_layout`)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from kvjax.cache._state import KERNEL_LAYOUTS, KERNEL_PAGE, LOWBIT_LAYOUTS
from kvjax.pallas_kernels.decode_attention import tuning_for
from kvjax.quant import check_kernel_layout, check_words_layout

LAYOUT_CHOICES = (*LOWBIT_LAYOUTS, "auto")


def check_layout(owner: str, layout: str) -> None:
    """A ValueError naming `owner` unless `layout` is one of LAYOUT_CHOICES."""
    if layout not in LAYOUT_CHOICES:
        raise ValueError(f"{owner}.lowbit_layout must be one of {LAYOUT_CHOICES}, got {layout!r}")


def lowbit_layout(
    layout: str, *, page: int, head_dim: int, bits: int, value_group: int, dtype: Any
) -> str:
    """`layout` itself, or for "auto" the layout the current device's Tuning names
    (`lowbit_cache_layout`, the measured-faster kernel) where this cache can take it: 64-token
    pages, shapes the layout's check accepts and bfloat16 data (the kernel's query dtype); a
    Tuning naming "words" falls back to "kernel" where only that fits; "token" otherwise."""
    if layout != "auto":
        return layout
    named = tuning_for().lowbit_cache_layout
    if named not in KERNEL_LAYOUTS:
        return "token"
    if page != KERNEL_PAGE or jnp.dtype(dtype) != jnp.bfloat16 or head_dim % value_group:
        return "token"
    checks = {"words": check_words_layout, "kernel": check_kernel_layout}
    for name in ("words", "kernel") if named == "words" else ("kernel",):
        try:
            checks[name](head_dim, bits, head_dim // value_group)
        except ValueError:
            continue
        return name
    return "token"
