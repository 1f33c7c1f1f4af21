"""The kernel-IR aids: Triton IR read at lowering (no GPU), SASS loop counting."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.eval._kernel_ir import abstract_tiers, sass_loop_stats, triton_ir
from kvjax.pallas_kernels.decode_attention import decode_attention_lowbit_triton


def _sass(ops: list[str], branches: dict[int, int]) -> str:
    """Synthetic cuobjdump text: instruction i at address 16·i; branches {from index: to index}."""
    lines = ["        Function : kvjax_decode_int4", '    .headerflags    @"EF_CUDA_SM90"']
    for i, op in enumerate(ops):
        text = f"BRA 0x{16 * branches[i]:x}" if i in branches else f"{op} R1, R2, R3"
        pred = "@P0 " if i % 3 == 0 else ""
        lines.append(f"        /*{16 * i:04x}*/                   {pred}{text} ;   /* 0x000 */")
    return "\n".join(lines)


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(st.sampled_from(["FFMA", "IMAD", "LDS", "HMMA", "I2F"]), min_size=12, max_size=40),
    data=st.data(),
)
def test_sass_loop_stats_counts_the_longest_backward_loop(ops, data):
    n = len(ops)
    start = data.draw(st.integers(0, n - 6))
    end = data.draw(st.integers(start + 3, n - 2))  # the main loop's back branch
    inner = data.draw(st.integers(start + 1, end - 1))  # a shorter loop inside it
    branches = {end: start, inner: start + 1, n - 1: n - 1}  # and a branch to itself (exit spin)
    got = sass_loop_stats(_sass(ops, branches), tokens_per_iteration=4)
    body = ["BRA" if i in branches else ops[i] for i in range(start, end + 1)]  # brute force
    assert got["instructions"] == len(body)
    assert got["per_token"] == pytest.approx(len(body) / 4)
    assert got["ops"] == {op: pytest.approx(body.count(op) / 4) for op in set(body)}


def test_sass_without_a_loop_is_named():
    with pytest.raises(ValueError, match="no backward branch"):
        sass_loop_stats(_sass(["FFMA"] * 5, {4: 4}), tokens_per_iteration=1)


def test_triton_ir_reads_each_kernel_with_its_launch_knobs():
    q = jax.ShapeDtypeStruct((2, 8, 4, 128), jnp.bfloat16)
    q_pos = jax.ShapeDtypeStruct((2,), jnp.int32)
    _, _, lowbit = abstract_tiers(2, 8, 128, 64, 64, 20, 32, 32, 4, jnp.bfloat16)
    fn = functools.partial(
        decode_attention_lowbit_triton, bits=4, scale=0.1, block_k=64, num_warps=8, num_stages=3
    )
    [kernel] = triton_ir(fn, q, lowbit, q_pos)
    assert (kernel["name"], kernel["num_warps"], kernel["num_stages"]) == (
        "kvjax_decode_int4",
        8,
        3,
    )
    assert "tt.func public @kvjax_decode_int4" in kernel["ttir"]
    assert kernel["ttir"].count("tt.dot") == 8  # 4 channel chunks × (QK, PV) at INT4, D = 128
