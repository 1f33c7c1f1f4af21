"""Fixed-shape KV cache state and its memory accounting."""

from kvjax.cache._bytes import (
    TIERS,
    attended_slots_per_layer,
    layer_slot_bytes,
    live_bytes,
    live_slots_per_layer,
    physical_bytes,
    slot_bytes_per_layer,
    slots_to_bytes,
)
from kvjax.cache._ops import write_slots
from kvjax.cache._stack import (
    StackedLayer,
    is_stacked,
    layer_at,
    num_layers,
    stack_cache,
    stack_trees,
    unstack_cache,
)
from kvjax.cache._state import (
    EMPTY,
    Cache,
    CacheSpec,
    Int8Tier,
    KernelLowBitTier,
    LayerCache,
    LowBitTier,
    init_cache,
    lowbit_page_bytes,
)

__all__ = [
    "EMPTY",
    "TIERS",
    "Cache",
    "CacheSpec",
    "Int8Tier",
    "KernelLowBitTier",
    "LayerCache",
    "LowBitTier",
    "StackedLayer",
    "attended_slots_per_layer",
    "init_cache",
    "is_stacked",
    "layer_at",
    "layer_slot_bytes",
    "live_bytes",
    "live_slots_per_layer",
    "lowbit_page_bytes",
    "num_layers",
    "physical_bytes",
    "slot_bytes_per_layer",
    "slots_to_bytes",
    "stack_cache",
    "stack_trees",
    "unstack_cache",
    "write_slots",
]
