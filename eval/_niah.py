"""Needle in a haystack through a policy's cache: a grid of context lengths × needle depths.

Three protocols, never mixed. Two run the policy's bounded cache all along: *query-aware* streams
context and question together through chunked prefill (a policy may use the question's attention);
*query-agnostic* prefills (compresses) the context alone, then appends the question, which (and
the answer) may evict context. *press* is kvpress's: the whole context is compressed once
(`press_context`: KVzip's reconstruction passes, ExpectedAttention's statistics, any other policy
with the whole context as one chunk), then question and answer append without evicting any of it
(full-precision policies only, as RULER's grid). Prompts and scoring: `_niah_prompt`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import Cache, CacheSpec, live_bytes
from kvjax.generate import (
    GenerateConfig,
    cache_spec_for,
    generate_from_cache,
    new_cache,
    prefill_cache,
)
from kvjax.generate._step import check_scannable
from kvjax.models import ModelConfig, Params, stack_params
from kvjax.policies import Policy
from kvjax.weights import LoadedModel

from ._niah_prompt import (
    BUFFER,
    DEFAULT_TEMPLATE,
    NEEDLE,
    QUESTION,
    SCORING_RULE,
    NiahPrompt,
    NiahProtocol,
    NiahTemplate,
    build_niah_prompt,
    check_niah_grid,
    haystack_text,
    score_niah_answer,
)
from ._press import PRESS_SCORED, is_tiered
from ._ruler import answer_pressed

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class NiahCell:
    """One (length, depth) result (JSON-ready)."""

    length: int
    depth: float
    needle_depth: float
    score: float
    soft_score: float
    answer: str
    answer_tokens: list[int]
    prompt_tokens: int
    live_kv_bytes: int
    seconds: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class NiahResult:
    """A grid for one policy and protocol (JSON-ready via dataclasses.asdict)."""

    model: str
    policy: str
    budget: int | None
    protocol: str
    lengths: list[int]
    depths: list[float]
    mean_score: float
    mean_score_by_length: dict[str, float]
    needle: str
    question: str
    scoring: str
    template: dict[str, str | None]
    buffer: int
    max_new_tokens: int
    cells: list[NiahCell]
    ratio: float | None = None
    budgets: dict[str, int] | None = None


def run_niah(
    model: LoadedModel,
    policy: Policy | Callable[[int], Policy],
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    protocol: NiahProtocol | str,
    label: str | None = None,
    budget: int | None = None,
    ratio: float | None = None,
    max_new_tokens: int = 32,
    template: NiahTemplate = DEFAULT_TEMPLATE,
    chunk_size: int = 256,
    haystack: str | None = None,
    on_cell: Callable[[NiahCell], None] | None = None,
    scan_layers: bool = False,
) -> NiahResult:
    """Greedy answers over a grid of context lengths × needle depths, one protocol.

    Args:
        model: weights and tokenizer (with a chat template).
        policy: the cache policy, or a function of the context length giving it (a budget per
            length, e.g. a compression ratio's: `budget_from_compression(ratio, length)`).
        lengths: context lengths in tokens (prompt + answer fit in each).
        depths: needle depths in percent of the haystack, in [0, 100].
        protocol: NiahProtocol or its value ("query-aware", "query-agnostic", "press").
        label: the policy's name in the result (default policy.name; e.g. a preset's name).
        budget: recorded in the result only.
        ratio: recorded in the result only (with each length's budget, when `policy` is a
            function).
        max_new_tokens: answer length cap (generation also stops at the tokenizer's EOS ids).
        chunk_size: prompt tokens per prefill call; prompts are padded to one bucket per cache
            shape (`shared_buckets`), so every cell of a shape reuses one compilation.
        haystack: text instead of the essays (tests).
        on_cell: called after each cell (progress bars).
        scan_layers: run the layers in one `lax.scan` over a stacked cache, both bounded
            protocols (`GenerateConfig.scan_layers`): each cache shape compiles one layer, not
            one per layer; the same answers and live bytes. Params are stacked once here (no
            copy when `model.params` already are: `stack_params`). `press` scans its prefill
            wherever the policy allows one, whatever this says.

    Raises:
        ValueError: bad grid, protocol, or a length that cannot hold the buffer / the haystack;
            `scan_layers` with a policy of per-layer budgets (pyramid) under a bounded protocol,
            a press-scored policy (kvzip, expected, adakv over them) under a bounded protocol,
            a tiered (INT8/low-bit) policy under `press`; before any cell runs.
    """
    if protocol not in tuple(NiahProtocol):
        raise ValueError(
            f"unknown protocol {protocol!r}; choose one of {[p.value for p in NiahProtocol]}"
        )
    protocol = NiahProtocol(protocol)
    check_niah_grid(lengths, depths)
    tok, config = model.tokenizer, model.config
    if tok is None:
        raise ValueError(f"model {model.source} has no tokenizer; NIAH needs one")
    hay = tok.encode(haystack_text() if haystack is None else haystack)
    grid = {
        n: [build_niah_prompt(tok, hay, length=n, depth=d, template=template) for d in depths]
        for n in lengths
    }  # every bad length fails before any compute
    for n, prompts in grid.items():
        extra = len(prompts[0].context) + len(prompts[0].question) - (n - BUFFER)
        if extra + max_new_tokens > BUFFER:
            raise ValueError(
                f"template ({extra} tokens) + max_new_tokens ({max_new_tokens}) "
                f"exceed the {BUFFER}-token buffer"
            )
        if config.max_positions and n > config.max_positions:
            raise ValueError(
                f"context length {n} exceeds the model's {config.max_positions} learned positions"
            )
    policies = {n: policy if isinstance(policy, Policy) else policy(n) for n in grid}
    dtype = jax.tree_util.tree_leaves(model.params)[0].dtype
    press = protocol is NiahProtocol.PRESS
    if press and not isinstance(model.params.layers, tuple):
        raise ValueError(
            "protocol 'press' needs the model's per-layer params (model.params are stacked); "
            "run_niah stacks them itself"
        )
    if press:
        for n, q in policies.items():
            if is_tiered(cache_spec_for(config, q, batch=1, max_len=n, dtype=dtype)):
                raise ValueError(
                    f"protocol 'press' keeps full-precision tokens; policy {q.name!r} is tiered "
                    "(INT8/low-bit): run it under query-aware or query-agnostic"
                )
    else:
        for q in policies.values():
            if isinstance(getattr(q, "press", q), PRESS_SCORED):
                raise ValueError(
                    f"policy {label or q.name!r} scores the context once at prefill from extra "
                    "model passes; in a bounded cache it has no scores (it keeps the first tokens "
                    f"and the question leaves with the window): run it under protocol 'press'"
                )
            if scan_layers:
                check_scannable(q, "run_niah(scan_layers=True)")
    params = stack_params(model.params, model.config) if scan_layers or press else model.params
    gen = GenerateConfig(
        max_new_tokens=max_new_tokens, stop_tokens=tok.eos_ids, chunk_size=chunk_size
    )
    cells = []
    buckets = shared_buckets(
        {n: cache_spec_for(config, policies[n], batch=1, max_len=n, dtype=dtype) for n in grid},
        chunk_size,
    )
    for n, prompts in grid.items():
        bucket = buckets[n][1]
        for depth, p in zip(depths, prompts, strict=True):
            t0 = time.perf_counter()
            if press:
                ids, cache, _ = answer_pressed(
                    model, policies[n], p.context, p.question, gen, question_multiple=16,
                    scan_params=params, dtype=dtype,
                )  # fmt: skip
            else:
                empty = new_cache(
                    config, policies[n], batch=1, max_len=n, dtype=dtype, stacked=scan_layers
                )
                ids, cache = _answer(config, params, policies[n], gen, empty, p, protocol, bucket)
            answer = tok.decode(ids, skip_special=True)
            score, soft = score_niah_answer(answer)
            cells.append(
                NiahCell(
                    length=n,
                    depth=float(depth),
                    needle_depth=p.needle_depth,
                    score=score,
                    soft_score=soft,
                    answer=answer,
                    answer_tokens=ids,
                    prompt_tokens=len(p.context) + len(p.question),
                    live_kv_bytes=int(live_bytes(cache)[0]),
                    seconds=time.perf_counter() - t0,
                )
            )
            if on_cell is not None:
                on_cell(cells[-1])
    by_len = {str(n): float(np.mean([c.score for c in cells if c.length == n])) for n in grid}
    return NiahResult(
        model=config.name,
        policy=label or next(iter(policies.values())).name,
        budget=budget,
        protocol=protocol.value,
        lengths=list(grid),
        depths=[float(d) for d in depths],
        mean_score=float(np.mean([c.score for c in cells])),
        mean_score_by_length=by_len,
        needle=NEEDLE,
        question=QUESTION,
        scoring=SCORING_RULE,
        template=dataclasses.asdict(template),
        buffer=BUFFER,
        max_new_tokens=max_new_tokens,
        cells=cells,
        ratio=ratio,
        budgets=None
        if isinstance(policy, Policy)
        else {str(n): getattr(policies[n], "budget", None) for n in grid},
    )


def shared_buckets(
    specs: dict[int, CacheSpec], chunk_size: int
) -> dict[int, tuple[CacheSpec, int]]:
    """Each context length's cache spec and prompt bucket (padded prompt length), such that
    lengths whose caches have one shape (a bounded policy's, once the length exceeds its budget)
    share one compiled step: their prompts are padded to the largest bucket among them. Prefill
    stops at each prompt's own length, so the padding computes nothing."""
    out = {}
    for n, spec in specs.items():
        longest = max(m for m, other in specs.items() if other == spec)
        out[n] = (spec, -(-longest // chunk_size) * chunk_size)
    return out


def _padded(ids: list[int], size: int) -> tuple[Array, Array]:
    out = np.zeros((1, size), np.int32)
    out[0, : len(ids)] = ids
    return jnp.asarray(out), jnp.asarray([len(ids)], jnp.int32)


def _answer(
    config: ModelConfig,
    params: Params,
    policy: Policy,
    gen: GenerateConfig,
    cache: Cache,
    p: NiahPrompt,
    protocol: NiahProtocol,
    bucket: int,
) -> tuple[list[int], Cache]:
    """One cell's answer ids and final cache; `cache` is empty (stacked: a layer scan, with
    `params` stacked) and donated."""
    key = jax.random.key(0)
    if protocol is NiahProtocol.QUERY_AWARE:
        tokens = _padded(p.context + p.question, bucket)
        res, cache = generate_from_cache(config, policy, gen, params, cache, *tokens, key)
    else:
        cache, _ = prefill_cache(config, policy, gen, params, cache, *_padded(p.context, bucket))
        tail = dataclasses.replace(gen, chunk_size=-(-len(p.question) // 16) * 16)
        tokens = _padded(p.question, tail.chunk_size)
        res, cache = generate_from_cache(config, policy, tail, params, cache, *tokens, key)
    return np.asarray(res.tokens)[0, : int(res.num_generated[0])].tolist(), cache
