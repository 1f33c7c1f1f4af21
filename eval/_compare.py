"""Matched-memory comparison: every policy at the live-byte budget of a sliding window, perplexity
through its cache, one table and a Pareto plot (live bytes vs perplexity).

Memory is matched on *peak live bytes* (K/V data of occupied slots, scales included, at steady
state): a policy's token budget is the largest whose cache cannot exceed the window's bytes. For
CONF-KV the peak is its loose budget; its mean live bytes (sawtooth) are reported too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from kvjax.cache import CacheSpec, lowbit_page_bytes
from kvjax.generate import cache_spec_for
from kvjax.models import ModelConfig
from kvjax.policies import BUDGETLESS, Policy, make_policy
from kvjax.weights import LoadedModel


def peak_live_bytes(spec: CacheSpec, unit_bytes: tuple[int, int, int]) -> int:
    """Bytes of K/V data when every unit of every tier is occupied (all layers, heads, batch)."""
    fp, q, page = unit_bytes
    q_caps = spec.int8_capacities or (0,) * spec.num_layers
    pages = spec.lowbit_pages or (0,) * spec.num_layers
    per_head = sum(
        c * fp + cq * q + p * page for c, cq, p in zip(spec.capacities, q_caps, pages, strict=True)
    )
    return spec.batch * spec.num_kv_heads * per_head


def policy_peak_bytes(policy: Policy, config: ModelConfig, max_len: int, itemsize: int) -> int:
    """Peak live bytes of the policy's cache for one sequence: every slot of every tier occupied
    plus the current token (what a step attends), or the policy's own bound when it enforces a
    byte budget (QEvict)."""
    dtype = {2: jnp.bfloat16, 4: jnp.float32}[itemsize]
    spec = cache_spec_for(config, policy, batch=1, max_len=max_len, dtype=dtype)
    bound = policy.live_bytes_bound(spec)
    if bound is not None:
        return bound
    d, g = config.head_dim, spec.lowbit_page_size
    page = lowbit_page_bytes(d, g, spec.lowbit_bits, min(spec.lowbit_value_group, d))
    current = spec.num_layers * spec.num_kv_heads * 2 * d * itemsize
    return peak_live_bytes(spec, (2 * d * itemsize, 2 * d + 8, page)) + current


def matched_budget(
    make: Callable[[int], Policy],
    config: ModelConfig,
    target: int,
    itemsize: int,
    *,
    max_tokens: int,
) -> int:
    """Largest budget whose peak live bytes fit in `target`. Budgets below a policy's minimum
    (it raises ValueError) are skipped; bytes grow with the budget, so bisection finds the edge."""

    def valid(b: int) -> bool:
        try:  # the policy accepts b, and its cache can be laid out (QEvict checks bytes there)
            policy_peak_bytes(make(b), config, max_tokens, itemsize)
            return True
        except ValueError:
            return False

    def bisect(ok, lo: int, hi: int) -> int:
        """Largest b in [lo, hi] with ok(b), given ok(lo) and ok monotone decreasing."""
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
        return lo

    cap = 16 * max_tokens
    if not valid(cap):
        raise ValueError(f"the policy rejects every budget up to {cap}")
    smallest = 1 if valid(1) else bisect(lambda b: not valid(b), 1, cap) + 1
    bytes_of = lambda b: policy_peak_bytes(make(b), config, max_tokens, itemsize)
    if bytes_of(smallest) > target:
        raise ValueError(
            f"even the smallest budget ({smallest}) of this policy needs "
            f"{bytes_of(smallest)} bytes > {target}"
        )
    return bisect(lambda b: bytes_of(b) <= target, smallest, cap)


# Table rows: label -> (registry name, fixed kwargs). `full` is the unbounded reference.
ROWS: dict[str, tuple[str, dict]] = {
    "full": ("full", {}),
    "window": ("window", {}),
    "streaming": ("streaming", {}),
    "h2o": ("h2o", {}),
    "tova": ("tova", {}),
    "snapkv": ("snapkv", {}),
    "random": ("random", {}),
    "kivi": ("kivi", {}),
    "confkv": ("confkv", {"int8": False}),
    "confkv+int8": ("confkv", {"int8": True}),
    "confkv-l": ("confkv-l", {"int8": True}),
    "qevict": ("qevict", {}),
    "qevict-int4": ("qevict", {"bits": 4}),
    "kvpop": ("kvpop", {}),
    "kvpop-mlp": ("kvpop-mlp", {}),
    # kvpress's presses that score inside the loop (kvzip/expected need `press_context`)
    "knorm": ("knorm", {}),
    "keydiff": ("keydiff", {}),
    "chunkkv": ("chunkkv", {}),
    "pyramidkv": ("pyramidkv", {}),
    "adakv-keydiff": ("adakv", {"press": "keydiff"}),
    "adakv-h2o": ("adakv", {"press": "h2o"}),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompareRow:
    label: str
    window: int
    budget: int | None
    target_bytes: int
    peak_live_bytes: int
    ppl: float
    live_bytes_mean: float
    live_bytes_peak: int
    seconds: float


def run_compare(
    model: LoadedModel,
    labels: Sequence[str],
    *,
    windows: Sequence[int],
    n_tokens: int,
    text: str = "avg.txt",
    cache_dtype: str = "bfloat16",
    progress: bool = True,
) -> list[CompareRow]:
    """Perplexity of each policy at the peak live bytes of each window size."""
    from kvjax.eval._ppl import run_ppl

    unknown = [x for x in labels if x not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; choose from {list(ROWS)}")
    itemsize = np.dtype(cache_dtype).itemsize if cache_dtype != "bfloat16" else 2
    cfg = model.config
    rows = []
    done = {}
    for w in windows:
        target = policy_peak_bytes(make_policy("window", w), cfg, n_tokens, itemsize)
        for label in labels:
            name, kw = ROWS[label]
            if name in BUDGETLESS:  # no eviction: memory is whatever the method needs
                policy, budget = make_policy(name), None
            else:
                make = lambda b, name=name, kw=kw: make_policy(
                    name, b, num_layers=cfg.num_layers, **kw
                )
                budget = matched_budget(make, cfg, target, itemsize, max_tokens=n_tokens)
                policy = make(budget)
            if name in BUDGETLESS and name in done:  # independent of the window size
                res = done[name]
            else:
                res = run_ppl(
                    model,
                    policy,
                    n_tokens=n_tokens,
                    text=text,
                    budget=budget,
                    cache_dtype=cache_dtype,
                    progress=progress,
                )
                done[name] = res
            rows.append(
                CompareRow(
                    label=label,
                    window=w,
                    budget=budget,
                    target_bytes=target,
                    peak_live_bytes=policy_peak_bytes(policy, cfg, n_tokens, itemsize),
                    ppl=res.ppl,
                    live_bytes_mean=res.live_bytes_mean,
                    live_bytes_peak=res.live_bytes_peak,
                    seconds=res.seconds,
                )
            )
    return rows


def plot_pareto(rows: Sequence[CompareRow], path: str, *, title: str) -> None:
    """Live bytes (mean, MiB) vs perplexity, one marker per policy, one colour per window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 5.5))
    labels = sorted({r.label for r in rows}, key=list(ROWS).index)
    markers = {label: "o^svDP*Xhp<>"[i % 12] for i, label in enumerate(labels)}
    for label in labels:
        pts = [r for r in rows if r.label == label]
        ax.plot(
            [r.live_bytes_mean / 2**20 for r in pts],
            [r.ppl for r in pts],
            marker=markers[label],
            ls="-" if len(pts) > 1 else "",
            label=label,
        )
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("mean live KV bytes (MiB, log scale)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
