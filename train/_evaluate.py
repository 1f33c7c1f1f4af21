"""Held-out boundary accuracy of a scorer against the teacher, with two baselines at the same
budget: recency only (always keep the token leaving the window) and H2O's accumulated attention
(a score that changes with q, so its ranking is recomputed at every query)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kvjax.models import ModelConfig, Params
from kvjax.scorers import Params as ScorerParams
from kvjax.scorers import ScorerConfig, make_scorer
from kvjax.train._data import LabelSpec
from kvjax.train._loss import boundary_labels, dynamic_decisions, own_decisions
from kvjax.train._targets import HeadAggregate
from kvjax.train._teacher import accumulated_mass, teacher_activations


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoundaryAccuracy:
    """Fractions of the teacher's keep/evict decisions each ranking agrees with.

    Attributes:
        decisions: how many decisions (queries × layers × KV heads × sequences).
        teacher_keep_rate: share of decisions where the teacher keeps t_new.
        scorer: the learned scorer's own running top-k decisions.
        recency: always keep the newest (the decision of a sliding window / StreamingLLM).
        h2o: rank by accumulated attention mass up to the query (H2O's score).
    """

    decisions: int
    teacher_keep_rate: float
    scorer: float
    recency: float
    h2o: float


def boundary_accuracy(
    model: ModelConfig,
    model_params: Params,
    scorer_config: ScorerConfig,
    scorer_params: ScorerParams,
    tokens: np.ndarray,
    spec: LabelSpec,
    *,
    rank_decay: float = 0.0,
    progress: bool = False,
) -> BoundaryAccuracy:
    """Agreement with the teacher over held-out sequences `tokens` [N, S] int32 (S × S memory
    for the H2O baseline: keep S to a few thousand).

    `rank_decay` λ ranks the scorer's tokens by r̂_t + λ·t, as the `kvpop` policy does at
    inference (its `decay`); the teacher's labels keep `spec.decay`."""
    module = make_scorer(scorer_config)
    budget = dict(sinks=spec.sinks, window=spec.window, k=spec.k)
    agree = np.zeros(3, np.int64)
    decisions = keeps = 0
    rows = range(len(tokens))
    if progress:
        from tqdm.auto import tqdm

        rows = tqdm(rows, desc="boundary accuracy", unit="seq")
    for i in rows:
        tok = jnp.asarray(tokens[i : i + 1])
        t = teacher_activations(
            model, model_params, tok, window=spec.window, aggregate=HeadAggregate(spec.aggregate)
        )
        lab = boundary_labels(t.log_mass, **budget, decay=spec.decay)
        scores = module.apply({"params": scorer_params}, t.k, t.v, window=spec.window)
        if rank_decay:
            pos = jnp.arange(scores.shape[-1], dtype=jnp.float32)
            scores = scores + rank_decay * pos.reshape((1,) * (scores.ndim - 1) + pos.shape)
        cum = accumulated_mass(model, model_params, tok)
        decided = np.asarray(lab.weight > 0)
        truth = np.asarray(lab.y > 0)
        ways = (
            np.asarray(own_decisions(scores, **budget)),
            np.ones_like(truth),
            np.asarray(dynamic_decisions(cum, **budget)),
        )
        agree += [int(np.sum(decided & (w == truth))) for w in ways]
        decisions += int(decided.sum())
        keeps += int(np.sum(decided & truth))
    n = max(decisions, 1)
    return BoundaryAccuracy(
        decisions=decisions,
        teacher_keep_rate=keeps / n,
        scorer=agree[0] / n,
        recency=agree[1] / n,
        h2o=agree[2] / n,
    )
