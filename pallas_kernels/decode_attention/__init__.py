"""Decode attention over kvjax's mixed-precision cache tiers (GQA, split-K, fused dequantization).

`decode_attention` runs every tier through its kernel and combines them; the per-backend kernels
(`decode_attention_triton`, `decode_attention_lowbit_triton`, `decode_attention_mgpu` (Mosaic
GPU, full and INT8 tiers), `decode_attention_mgpu_tm` (Mosaic GPU, slots on the dots'
M axis, full and INT8 tiers), `decode_attention_pages_mgpu` (Mosaic GPU, QEvict's low-bit
8-token pages), `decode_attention_pooled_triton` (a slot pool shared by the KV heads),
`decode_attention_tpu`, `decode_attention_lowbit_tpu`), `decode_partials` (the tiers' split
partials uncombined), `join_new_token` (those partials and a decode step's own token merged in
one launch) and the plain-jnp
`decode_attention_reference` are public too.
"""

from kvjax.pallas_kernels.decode_attention._api import (
    BACKENDS,
    Backend,
    DecodeResult,
    KernelFallbackWarning,
    decode_attention,
    decode_partials,
    default_backend,
    slots_on_m,
)
from kvjax.pallas_kernels.decode_attention._channel_major import PAGE as MGPU_LOWBIT_PAGE
from kvjax.pallas_kernels.decode_attention._channel_major import to_channel_major
from kvjax.pallas_kernels.decode_attention._combine import attention_mass, combine
from kvjax.pallas_kernels.decode_attention._combine_triton import combine_triton
from kvjax.pallas_kernels.decode_attention._join import join_applies, join_new_token
from kvjax.pallas_kernels.decode_attention._mgpu import decode_attention_mgpu
from kvjax.pallas_kernels.decode_attention._mgpu_lowbit import decode_attention_lowbit_mgpu
from kvjax.pallas_kernels.decode_attention._mgpu_pages import decode_attention_pages_mgpu
from kvjax.pallas_kernels.decode_attention._mgpu_tm import decode_attention_mgpu_tm
from kvjax.pallas_kernels.decode_attention._reference import decode_attention_reference
from kvjax.pallas_kernels.decode_attention._tiers import (
    ChannelMajorLowBitTier,
    FullTier,
    Int8Tier,
    LowBitTier,
    Partials,
    PooledTier,
)
from kvjax.pallas_kernels.decode_attention._tpu import decode_attention_tpu
from kvjax.pallas_kernels.decode_attention._tpu_lowbit import decode_attention_lowbit_tpu
from kvjax.pallas_kernels.decode_attention._triton import decode_attention_triton
from kvjax.pallas_kernels.decode_attention._triton_lowbit import decode_attention_lowbit_triton
from kvjax.pallas_kernels.decode_attention._triton_pooled import decode_attention_pooled_triton
from kvjax.pallas_kernels.decode_attention._tuning import (
    MGPU_TIERS,
    TUNINGS,
    Tuning,
    tuning_for,
    tuning_overrides,
)

__all__ = [
    "BACKENDS",
    "MGPU_LOWBIT_PAGE",
    "ChannelMajorLowBitTier",
    "TUNINGS",
    "Backend",
    "DecodeResult",
    "FullTier",
    "Int8Tier",
    "KernelFallbackWarning",
    "LowBitTier",
    "MGPU_TIERS",
    "Partials",
    "PooledTier",
    "Tuning",
    "attention_mass",
    "combine",
    "combine_triton",
    "decode_attention",
    "decode_attention_lowbit_mgpu",
    "decode_attention_lowbit_tpu",
    "decode_attention_lowbit_triton",
    "decode_attention_mgpu",
    "decode_attention_mgpu_tm",
    "decode_attention_pages_mgpu",
    "decode_attention_pooled_triton",
    "decode_attention_reference",
    "decode_attention_tpu",
    "decode_attention_triton",
    "decode_partials",
    "default_backend",
    "join_applies",
    "join_new_token",
    "slots_on_m",
    "to_channel_major",
    "tuning_for",
    "tuning_overrides",
]
