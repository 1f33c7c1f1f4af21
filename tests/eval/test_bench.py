"""The decode benchmark measures what it says: live/physical bytes follow the formulas."""

import pytest

from kvjax.eval import bench_decode
from kvjax.policies import make_policy


@pytest.mark.parametrize("name,budget", [("full", None), ("window", 32), ("streaming", 32)])
def test_bench_decode_byte_accounting(tiny_llama, name, budget):
    config, params = tiny_llama
    policy = make_policy(name, budget)
    r = bench_decode(
        config,
        params,
        policy,
        context=128,
        batch=2,
        steps=4,
        budget=budget,
        fill_chunk=64,
        copy_bytes=1 << 20,
    )
    slot = 2 * config.head_dim * 4  # K+V float32
    kept = 128 if name == "full" else 32
    assert r.live_kv_bytes == 2 * config.num_layers * config.num_kv_heads * kept * slot
    capacity = policy.capacity(128 + 2 * 4 + 1)
    # Physical: K, V data + int32 positions + float32 scores, per slot, plus [B] lengths.
    per_slot = slot + 4 + 4
    assert r.physical_kv_bytes == (
        2 * config.num_layers * config.num_kv_heads * capacity * per_slot + 2 * 4
    )
    assert r.ms_per_step > 0 and r.tokens_per_s == pytest.approx(2e3 / r.ms_per_step)


def test_bench_rejects_ragged_fill(tiny_llama):
    config, params = tiny_llama
    with pytest.raises(ValueError, match="multiple of fill_chunk"):
        bench_decode(
            config, params, make_policy("full"), context=100, batch=1, steps=1, fill_chunk=64
        )


@pytest.mark.parametrize("name,budget", [("confkv", 160), ("qevict", 64)])
def test_bench_decode_runs_tiered_policies(tiny_llama, name, budget):
    """Policies with INT8 or low-bit tiers get their tiers' attention mass in the synthetic fill;
    live bytes stay within what the budget allows."""
    config, params = tiny_llama
    policy = make_policy(name, budget, num_layers=config.num_layers)
    r = bench_decode(
        config,
        params,
        policy,
        context=256,
        batch=1,
        steps=4,
        budget=budget,
        fill_chunk=64,
        copy_bytes=1 << 20,
    )
    slot = 2 * config.head_dim * 4
    assert 0 < r.live_kv_bytes <= config.num_layers * config.num_kv_heads * budget * slot
