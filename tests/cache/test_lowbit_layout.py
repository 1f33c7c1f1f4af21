"""The low-bit tier's stored layout: bfloat16 statistics, and page bytes equal to its arrays."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import CacheSpec, init_cache, lowbit_page_bytes
from kvjax.quant import STAT_DTYPE


def test_lowbit_page_bytes_golden():
    # D 128, 32-token pages, 4 bits, value groups of 32: codes 2·32·128·4/8 = 4096, key scale+zero
    # per channel 2·128·2 = 512, value scale+zero per token and group 2·32·4·2 = 512.
    assert lowbit_page_bytes(128, 32, 4, 32) == 5120  # 160 per token
    assert lowbit_page_bytes(128, 32, 2, 32) == 3072  # 2048 + 512 + 512: 96 per token
    # float32 statistics (the layout before): 4096 + 1024 + 1024
    assert lowbit_page_bytes(128, 32, 4, 32, stat_bytes=4) == 6144


@pytest.mark.parametrize("bits, value_group", [(2, 8), (4, 16)])
def test_tier_stores_bfloat16_statistics_and_counts_its_arrays(bits, value_group):
    spec = CacheSpec(
        batch=2, num_kv_heads=3, head_dim=16, capacities=(5, 5), dtype=jnp.bfloat16,
        lowbit_pages=(4, 2), lowbit_page_size=8, lowbit_bits=bits, lowbit_value_group=value_group,
    )  # fmt: skip
    for layer, pages in zip(init_cache(spec).layers, spec.lowbit_pages, strict=True):
        lb = layer.lowbit
        stats = (lb.k_scale, lb.k_zero, lb.v_scale, lb.v_zero)
        assert all(a.dtype == STAT_DTYPE == jnp.bfloat16 for a in stats)
        per_page = sum(a.size * a.dtype.itemsize for a in (lb.k, lb.v, *stats))
        per_page //= spec.batch * spec.num_kv_heads * pages
        assert lb.page_bytes() == per_page
        assert lb.page_bytes() == lowbit_page_bytes(16, 8, bits, value_group)
        np.testing.assert_array_equal(np.asarray(lb.k_scale, np.float32), 0.0)
