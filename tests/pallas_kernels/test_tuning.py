"""The decode kernels' Tuning: every field checked when a Tuning is made (table entries and
KVJAX_TUNING overrides), and a warning where a kernel the Tuning names does not apply."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_cases import Case, make_tiers, stack_layers
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.cache._state import LOWBIT_LAYOUTS
from kvjax.pallas_kernels.decode_attention import (
    MGPU_TIERS,
    TUNINGS,
    KernelFallbackWarning,
    Tuning,
    _tuning,
    combine,
    decode_attention,
    tuning_for,
)

_FIELDS = {f.name: f for f in dataclasses.fields(Tuning)}
_COUNTS = [n for n, f in _FIELDS.items() if f.type == "int"]
_WIDTHS = [n for n, f in _FIELDS.items() if f.type == "tuple[int, ...]"]


def test_every_table_entry_is_a_valid_tuning():
    for kind, tune in {**TUNINGS, "default": _tuning.DEFAULT}.items():
        assert dataclasses.replace(tune) == tune, kind  # replace re-runs the checks
        assert set(tune.mgpu_tiers) <= set(MGPU_TIERS), kind


def test_the_layout_names_are_the_caches():
    assert _tuning.LOWBIT_CACHE_LAYOUTS == LOWBIT_LAYOUTS


@pytest.mark.parametrize(
    "changes, what",
    [
        (dict(mgpu_tiers=("fulltm",)), "mgpu_tiers: unknown tier 'fulltm'; known: full, int8"),
        (dict(mgpu_tiers=("full", "lowbit")), "mgpu_tiers: unknown tier 'lowbit'"),
        (dict(mgpu_lowbit_fold_keys=(3,)), "mgpu_lowbit_fold_keys lists bit widths .* got 3"),
        (dict(lowbit_int8_qk_bits=(4, 8)), "lowbit_int8_qk_bits .* got 8"),
        (dict(num_stages=0), "num_stages must be >= 1, got 0"),
        (dict(target_programs=-4), "target_programs must be >= 1, got -4"),
        (dict(block_k=48), "block_k must be a power of 2, got 48"),
        (dict(block_k=8), "block_k must be >= 16, got 8"),
        (dict(lowbit_stacked_pages=3), "lowbit_stacked_pages must be a power of 2"),
        (dict(lowbit_cache_layout="channels"), "lowbit_cache_layout must be one of .* 'channels'"),
    ],
)
def test_a_bad_field_is_one_error_naming_it(changes, what):
    with pytest.raises(ValueError, match=f"Tuning.{what}"):
        Tuning(**changes)


@pytest.mark.parametrize(
    "text, what",
    [
        ("mgpu_tiers=full-tm+fulltm", "mgpu_tiers: unknown tier 'fulltm'"),
        ("mgpu_tiers=2", "mgpu_tiers: unknown tier 2"),
        ("mgpu_lowbit_qk_split=x", "mgpu_lowbit_qk_split lists bit widths .* got 'x'"),
        ("mgpu_stages=0", "mgpu_stages must be >= 1"),
        ("lowbit_cache_layout=bytes", "lowbit_cache_layout must be one of"),
    ],
)
def test_a_bad_override_is_one_error_naming_the_variable_and_field(monkeypatch, text, what):
    monkeypatch.setenv("KVJAX_TUNING", text)
    with pytest.raises(ValueError, match=f"KVJAX_TUNING: Tuning.{what}"):
        tuning_for()


@settings(max_examples=40, deadline=None)
@given(
    field=st.sampled_from(_COUNTS),
    value=st.integers(-3, 300),
)
def test_counts_take_exactly_the_positive_values_their_field_allows(field, value):
    """A count is taken iff >= 1 (and, for block sizes, a power of two; block_k >= 16)."""
    ok = value >= 1
    if field in _tuning._POWERS_OF_TWO:
        ok = ok and value & (value - 1) == 0
    if field == "block_k":
        ok = ok and value >= 16
    if ok:
        assert getattr(Tuning(**{field: value}), field) == value
    else:
        with pytest.raises(ValueError, match=f"Tuning.{field} "):
            Tuning(**{field: value})


@settings(max_examples=40, deadline=None)
@given(field=st.sampled_from(_WIDTHS), widths=st.lists(st.integers(0, 9), max_size=3))
def test_bit_width_tuples_take_only_2_and_4(field, widths):
    if set(widths) <= {2, 4}:
        assert getattr(Tuning(**{field: tuple(widths)}), field) == tuple(widths)
    else:
        with pytest.raises(ValueError, match=f"Tuning.{field} lists bit widths"):
            Tuning(**{field: tuple(widths)})


def _full_tier(cap: int, seed: int = 0):
    """(q, the lone full tier, q_pos) of the kernel tests' random tiers at this capacity."""
    q, q_pos, full, _, _ = make_tiers(Case("bfloat16", "fp", ratio=4, head_dim=64, cap=cap), seed)
    return q, full, q_pos


def test_a_named_kernel_that_does_not_apply_warns_and_runs_triton(monkeypatch):
    """ "full-tm" asked for a full tier of 70 slots (the slots-on-M kernel needs a multiple of
    64): one KernelFallbackWarning naming the tier kind and why, and the Triton result."""
    q, tier, q_pos = _full_tier(70)
    run = lambda: decode_attention(q, q_pos, full=tier, scale=0.125, interpret=True)
    want = run()
    kind = jax.devices()[0].device_kind
    monkeypatch.setitem(TUNINGS, kind, dataclasses.replace(tuning_for(), mgpu_tiers=("full-tm",)))
    with pytest.warns(KernelFallbackWarning, match=r"'full-tm'.*capacity 70 \(needs a multiple"):
        got = run()
    np.testing.assert_array_equal(np.asarray(got.out), np.asarray(want.out))


def test_a_named_kernel_that_applies_does_not_warn(monkeypatch):
    q, tier, q_pos = _full_tier(128)
    kind = jax.devices()[0].device_kind
    monkeypatch.setitem(TUNINGS, kind, dataclasses.replace(tuning_for(), mgpu_tiers=("full-tm",)))
    fn = lambda q: decode_attention(q, q_pos, full=tier, scale=0.125, interpret=True).out
    jaxpr = str(jax.make_jaxpr(fn)(q))  # filterwarnings=error: a warning would fail this
    assert "mgpu_tm" in jaxpr


def test_the_dense_mosaic_kernel_named_for_a_stacked_tier_warns(monkeypatch):
    """ "full" names the dense Mosaic GPU kernel, which reads one layer: a stacked tier read in
    place (`layer=`) warns and runs Triton."""
    q, tier, q_pos = _full_tier(64)
    stack = stack_layers([tier, tier])
    kind = jax.devices()[0].device_kind
    monkeypatch.setitem(TUNINGS, kind, dataclasses.replace(tuning_for(), mgpu_tiers=("full",)))
    fn = lambda q: (
        decode_attention(q, q_pos, full=stack, scale=0.125, interpret=True, layer=jnp.int32(1)).out
    )
    with pytest.warns(KernelFallbackWarning, match=r"'full'.*a stacked tier read in place"):
        jax.make_jaxpr(fn)(q)


@settings(max_examples=200, deadline=None)
@given(
    batch=st.integers(1, 16),
    heads=st.integers(1, 8),
    blocks=st.integers(0, 2048),
    target=st.integers(1, 4096),
    floor=st.integers(1, 64),
)
def test_split_count_fills_the_target_but_keeps_each_split_at_its_floor(
    batch, heads, blocks, target, floor
):
    """Brute force: the split count is the largest S <= the target's share, <= blocks, whose
    splits hold >= floor blocks each, or 1 where no count above 1 does."""
    got = _tuning.num_splits(batch, heads, blocks, target, floor)
    share = -(-target // (batch * heads))
    ok = [s for s in range(1, blocks + 1) if s <= share and blocks // s >= floor]
    assert got == max(ok, default=1)
    assert _tuning.num_splits(batch, heads, blocks, target) == max(1, min(share, blocks))


@pytest.mark.parametrize("bad", [dict(min_blocks=0), dict(num_blocks=-1), dict(batch=-1)])
def test_split_count_of_a_bad_size_is_one_error(bad):
    args = dict(batch=1, kv_heads=8, num_blocks=512, target_programs=1056, min_blocks=16) | bad
    with pytest.raises(ValueError, match="num_splits: .* must be >= 1 and num_blocks >= 0"):
        _tuning.num_splits(**args)


def test_an_empty_tier_takes_one_split():
    assert _tuning.num_splits(1, 8, 0, 1056, 16) == 1


@pytest.mark.parametrize("tiers", ["fp", "fp+int8"])
def test_split_floor_sets_the_dispatch_splits_and_keeps_the_result(triton_tuned, tiers):
    """split_min_blocks caps the Triton dense kernels' default splits (one partial a split) and
    leaves the combined attention equal to the float32 rounding of the floorless run."""
    case = Case(dtype="float32", tiers=tiers, ratio=2, head_dim=64, cap=130)
    q, q_pos, full, int8, _ = make_tiers(case, 11)
    tier = int8 if tiers == "fp+int8" else full
    outs = {}
    for floor in (1, 4):
        tuned = Tuning(
            block_k=16, target_programs=64, int8_target_programs=64, split_min_blocks=floor
        )
        part = triton_tuned(tuned)(q, tier, q_pos, scale=0.125, interpret=True)
        cap_blocks = -(-tier.pos.shape[-1] // 16)
        want = _tuning.num_splits(q.shape[0], q.shape[1], cap_blocks, 64, floor)
        assert part.out.shape[2] == want
        outs[floor] = part
    assert outs[4].out.shape[2] < outs[1].out.shape[2]
    (got, got_lse), (ref, ref_lse) = (combine([outs[f]]) for f in (4, 1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(ref_lse), rtol=2e-6, atol=2e-6)


def test_an_int8_tier_splits_for_its_own_target(triton_tuned):
    """The Triton kernel's default splits follow int8_target_programs over an INT8 tier and
    target_programs over a full one."""
    case = Case(dtype="float32", tiers="fp+int8", ratio=2, head_dim=64, cap=130)
    q, q_pos, full, int8, _ = make_tiers(case, 12)
    kernel = triton_tuned(Tuning(block_k=16, target_programs=32, int8_target_programs=8))
    for tier, target in ((full, 32), (int8, 8)):
        part = kernel(q, tier, q_pos, scale=0.125, interpret=True)
        blocks = -(-tier.pos.shape[-1] // 16)
        assert part.out.shape[2] == _tuning.num_splits(2, 2, blocks, target)
