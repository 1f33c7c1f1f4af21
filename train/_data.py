"""Training data: the Paul Graham essays split by file, cut into token windows, and the teacher's
activations and labels for them, computed once and kept on the host."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models import ModelConfig, Params
from kvjax.train._loss import BoundaryLabels, Weighting, boundary_labels
from kvjax.train._targets import HeadAggregate
from kvjax.train._teacher import teacher_activations
from kvjax.weights import Tokenizer, essay_names, essay_text

# The first essays in sorted order are held out: they hold avg.txt (`kvjax ppl`'s default text)
# and the start of the NIAH haystack (essays concatenated in sorted order, ~25K tokens).
HELD_OUT_ESSAYS = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class EssaySplit:
    """Essay file names of each side (sorted)."""

    train: tuple[str, ...]
    held_out: tuple[str, ...]


def split_essays(
    names: Sequence[str] | None = None, *, held_out: int = HELD_OUT_ESSAYS
) -> EssaySplit:
    """The first `held_out` essays (sorted file names) are held out, the rest train."""
    names = sorted(essay_names() if names is None else names)
    if not 0 < held_out < len(names):
        raise ValueError(f"held_out must be in [1, {len(names) - 1}], got {held_out}")
    return EssaySplit(train=tuple(names[held_out:]), held_out=tuple(names[:held_out]))


def token_windows(
    tokenizer: Tokenizer, names: Sequence[str], *, seq_len: int, limit: int | None = None
) -> np.ndarray:
    """Non-overlapping windows of `seq_len` tokens from each essay in order (remainders dropped).

    Returns:
        [N, seq_len] int32, N <= limit.

    Raises:
        ValueError: seq_len < 2 or no essay is long enough.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    out: list[np.ndarray] = []
    for name in names:
        ids = np.asarray(tokenizer.encode(essay_text(name)), np.int32)
        n = len(ids) // seq_len
        out.extend(ids[: n * seq_len].reshape(n, seq_len))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"no essay among {list(names)[:5]}… has {seq_len} tokens")
    return np.stack(out[:limit])


@dataclasses.dataclass(frozen=True, kw_only=True)
class LabelSpec:
    """How the teacher's decisions are made (the budget the scorer is trained for).

    Attributes:
        sinks: s, leading tokens never evicted.
        window: w, the protected recent window.
        k: long-range slots.
        aggregate: query heads → KV head (`max` or `mean`).
        decay: λ, temporal decay in the teacher's ranking (r_t + λ·t).
        weighting: ω of each decision (`uniform` or `margin`).
    """

    sinks: int = 4
    window: int = 32
    k: int = 96
    aggregate: HeadAggregate = HeadAggregate.MAX
    decay: float = 0.0
    weighting: Weighting = Weighting.UNIFORM


@dataclasses.dataclass(frozen=True)
class TeacherData:
    """Host arrays for N sequences: k, v [N, S, L, Hkv, D] float16, log_mass [N, L, Hkv, S]
    float32, labels with [N, L, Hkv, S] leaves."""

    tokens: np.ndarray
    k: np.ndarray
    v: np.ndarray
    log_mass: np.ndarray
    labels: BoundaryLabels

    def __len__(self) -> int:
        return self.k.shape[0]

    def batch(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, BoundaryLabels]:
        return self.k[idx], self.v[idx], jax.tree.map(lambda a: a[idx], self.labels)


def build_teacher_data(
    config: ModelConfig,
    params: Params,
    tokens: np.ndarray,
    spec: LabelSpec,
    *,
    progress: bool = False,
) -> TeacherData:
    """Teacher activations and labels for `tokens` [N, S] int32, one sequence per forward."""
    rows = range(len(tokens))
    if progress:
        from tqdm.auto import tqdm

        rows = tqdm(rows, desc="teacher", unit="seq")
    ks, vs, masses, labels = [], [], [], []
    for i in rows:
        t = teacher_activations(
            config,
            params,
            jnp.asarray(tokens[i : i + 1]),
            window=spec.window,
            aggregate=HeadAggregate(spec.aggregate),
        )
        lab = boundary_labels(
            t.log_mass,
            sinks=spec.sinks,
            window=spec.window,
            k=spec.k,
            decay=spec.decay,
            weighting=spec.weighting,
        )
        ks.append(np.asarray(t.k, np.float16))
        vs.append(np.asarray(t.v, np.float16))
        masses.append(np.asarray(t.log_mass))
        labels.append(jax.tree.map(np.asarray, lab))
    return TeacherData(
        tokens=np.asarray(tokens),
        k=np.concatenate(ks),
        v=np.concatenate(vs),
        log_mass=np.concatenate(masses),
        labels=jax.tree.map(lambda *a: np.concatenate(a), *labels),
    )
