"""Policies by name, for the CLI and for the generic tests."""

from __future__ import annotations

import functools
import numbers
from typing import Any

from kvjax.policies._adakv import AdaKVPolicy
from kvjax.policies._base import Policy
from kvjax.policies._chunkkv import ChunkKVPolicy
from kvjax.policies._confkv import ConfKVPolicy
from kvjax.policies._expected import ExpectedAttentionPolicy
from kvjax.policies._full import FullPolicy
from kvjax.policies._h2o import H2OPolicy
from kvjax.policies._keydiff import KeyDiffPolicy
from kvjax.policies._kivi import KIVIPolicy
from kvjax.policies._knorm import KnormPolicy
from kvjax.policies._kvpop import KVpopPolicy
from kvjax.policies._kvzip import KVzipPolicy
from kvjax.policies._pyramidkv import PyramidKVPolicy
from kvjax.policies._qevict import QEvictPolicy
from kvjax.policies._random import RandomPolicy
from kvjax.policies._snapkv import SnapKVPolicy
from kvjax.policies._streaming import StreamingPolicy
from kvjax.policies._tova import TOVAPolicy
from kvjax.policies._window import WindowPolicy

POLICIES: dict[str, type[Policy] | functools.partial] = {
    cls.name: cls
    for cls in (
        FullPolicy,
        WindowPolicy,
        StreamingPolicy,
        H2OPolicy,
        TOVAPolicy,
        RandomPolicy,
        SnapKVPolicy,
        ConfKVPolicy,
        KIVIPolicy,
        KVpopPolicy,
        QEvictPolicy,
        # kvpress's presses
        KnormPolicy,
        KeyDiffPolicy,
        PyramidKVPolicy,
        ChunkKVPolicy,
        ExpectedAttentionPolicy,
        KVzipPolicy,
    )
}
# Named presets of a policy class.
POLICIES["confkv-l"] = functools.partial(ConfKVPolicy, pyramid=0.5)
POLICIES["kvpop-mlp"] = functools.partial(KVpopPolicy, scorer="mlp")
BUDGETLESS = frozenset({"full", "kivi"})
# Policies whose per-layer budgets need the model's layer count.
NEEDS_LAYERS = frozenset({"confkv", "confkv-l", "pyramidkv", "adakv"})


def _adakv(
    *,
    budget: int,
    press: str = "snapkv",
    alpha_safeguard: float = 0.20,
    num_layers: int | None = None,
    **press_kwargs: Any,
) -> AdaKVPolicy:
    """`adakv` by name: AdaKV over the policy named `press` (its kwargs passed through)."""
    if press == "adakv" or press not in POLICIES:
        raise ValueError(f"adakv: unknown press {press!r}; choose one of {sorted(POLICIES)}")
    if press in NEEDS_LAYERS and num_layers is not None:
        press_kwargs.setdefault("num_layers", num_layers)
    inner = make_policy(press, budget, **press_kwargs)
    return AdaKVPolicy(press=inner, alpha_safeguard=alpha_safeguard)


POLICIES["adakv"] = _adakv  # type: ignore[assignment]
# `adakv-<press>`: adakv over that press, each with its defaults (as `kvjax ruler`/`compare` rows).
ADAKV_PREFIX = "adakv-"


def make_policy(
    name: str, budget: int | None = None, *, num_layers: int | None = None, **kwargs: Any
) -> Policy:
    """Build a policy by name.

    Args:
        name: one of POLICIES, or `adakv-<press>` (`adakv` with `press=<press>`).
        budget: tokens kept per KV head per layer; required by every policy except `full`.
        num_layers: the model's layer count (per-layer budgets, e.g. confkv-l). None: the
            policy takes it from the model when it runs (`kvjax.generate`, `new_cache`,
            `model_step`); a policy built for another layer count is refused there.
        **kwargs: the policy's other hyperparameters.

    Raises:
        ValueError: unknown name, missing/unexpected budget, or invalid hyperparameters.
    """
    if name.startswith(ADAKV_PREFIX):
        press = name[len(ADAKV_PREFIX) :]
        if kwargs.setdefault("press", press) != press:
            raise ValueError(
                f"policy {name!r} wraps {press!r}; it was also given press={kwargs['press']!r}"
            )
        return make_policy("adakv", budget, num_layers=num_layers, **kwargs)
    if name not in POLICIES:
        raise ValueError(
            f"unknown policy {name!r}; choose one of {sorted(POLICIES)} or "
            f"{ADAKV_PREFIX}<press> (adakv over that press)"
        )
    cls = POLICIES[name]
    if "position_shift" in kwargs and name != "adakv" and not _has_field(cls, "position_shift"):
        raise ValueError(
            f"policy {name!r} has no position_shift (positions within the cache); it is a "
            f"setting of {', '.join(shifting_policies())}"
        )
    if name in BUDGETLESS:
        if budget is not None:
            raise ValueError(f"policy {name!r} keeps every token and takes no budget")
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ValueError(f"policy {name!r}: {e}") from None
    if budget is None:
        raise ValueError(f"policy {name!r} needs a budget (tokens attended per step per KV head)")
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
        raise ValueError(f"policy {name!r}: budget must be an int, got {budget!r}")
    if name in NEEDS_LAYERS and num_layers is not None:
        kwargs.setdefault("num_layers", num_layers)
    try:
        return cls(budget=budget, **kwargs)
    except TypeError as e:  # an unknown hyperparameter name
        raise ValueError(f"policy {name!r}: {e}") from None


def _has_field(cls: Any, field: str) -> bool:
    cls = cls.func if isinstance(cls, functools.partial) else cls
    return field in getattr(cls, "__dataclass_fields__", {})


def shifting_policies() -> tuple[str, ...]:
    """Names of the policies that take `position_shift` (positions within the cache)."""
    return tuple(n for n, c in POLICIES.items() if n != "adakv" and _has_field(c, "position_shift"))
