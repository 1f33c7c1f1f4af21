"""kvjax.testing.check_policy: built-in policies pass; each check catches the bug it is for."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from kvjax.policies import H2OPolicy, TOVAPolicy
from kvjax.testing import CHECKS, check_policy


@dataclasses.dataclass(frozen=True, kw_only=True)
class _IgnoresMassClaim(TOVAPolicy):
    """Ranks by attention mass but declares it does not read it."""

    uses_attention_mass = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class _OverBudget(H2OPolicy):
    """Lays out 4 slots more than its budget and fills them."""

    def capacities(self, num_layers, max_len):
        return tuple(c + 4 for c in super().capacities(num_layers, max_len))

    def ranked_budget(self, state, layer_index, batch):
        return jnp.full((batch,), self.budget + 4 - self.ring, jnp.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _HalvesValues(H2OPolicy):
    """Stores every value at half its size."""

    def write(self, layer, k_new, v_new, pos_new, valid, stats, state, *, layer_index):
        return super().write(
            layer, k_new, v_new * 0.5, pos_new, valid, stats, state, layer_index=layer_index
        )


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class _DriftingHash(H2OPolicy):
    """Its hash changes from call to call (as a hash over mutable state would), so every call
    misses the compilation cache."""

    calls: list = dataclasses.field(default_factory=list)

    def __hash__(self):
        self.calls.append(None)
        return len(self.calls)


def test_a_builtin_policy_passes_every_check(tiny_llama):
    report = check_policy(H2OPolicy(budget=16), model=tiny_llama)
    assert report.ok
    assert [r.name for r in report.results] == list(CHECKS)
    assert all(r.status == "pass" for r in report.results)
    assert "within_budget" in str(report)


@pytest.mark.parametrize(
    ("policy", "check"),
    [
        (_IgnoresMassClaim(budget=16), "attention_mass_declared"),
        (_OverBudget(budget=16), "within_budget"),
        (_HalvesValues(budget=16), "matches_full"),
        (_DriftingHash(budget=16), "compiles_once"),
    ],
    ids=lambda x: x if isinstance(x, str) else type(x).__name__,
)
def test_each_check_catches_its_bug(tiny_llama, policy, check):
    report = check_policy(policy, checks=[check], model=tiny_llama, raise_on_failure=False)
    assert report.failed == (check,)
    assert report.results[0].status == "fail"


def test_a_failure_raises_naming_the_check(tiny_llama):
    with pytest.raises(AssertionError, match="policy checks failed: attention_mass_declared"):
        check_policy(_IgnoresMassClaim(budget=16), checks=["attention_mass_declared"])


def test_a_builder_function_is_accepted(tiny_llama):
    report = check_policy(
        lambda b: TOVAPolicy(budget=b), checks=["attention_mass_declared"], model=tiny_llama
    )
    assert report.ok


def test_bad_input_is_a_clear_error():
    with pytest.raises(TypeError, match="must be a Policy or a function"):
        check_policy("h2o")
    with pytest.raises(TypeError, match=r"policy\(\d+\) returned a str"):
        check_policy(lambda b: "h2o")
    with pytest.raises(ValueError, match="unknown checks \\['speed'\\]"):
        check_policy(H2OPolicy(budget=16), checks=["speed"])
    with pytest.raises(ValueError, match="budget must be an int >= 1"):
        check_policy(H2OPolicy(budget=16), budget=0)
