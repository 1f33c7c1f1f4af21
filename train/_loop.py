"""The optax training loop of a KVpop scorer: AdamW with warmup + cosine decay and gradient
clipping, one jit-compiled step, deterministic batches, orbax checkpoints with exact resume."""

from __future__ import annotations

import dataclasses
import enum
import json
import pathlib
from typing import Any

import jax
import numpy as np
import optax

from kvjax.models import ModelConfig
from kvjax.scorers import Params, ScorerConfig, ScorerKind, init_scorer_params, make_scorer
from kvjax.train._checkpoint import Checkpoints
from kvjax.train._data import LabelSpec, TeacherData
from kvjax.train._loss import agreement, boundary_loss, own_decisions


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a training run (a resumed run must match it).

    Attributes:
        scorer: `mlstm` (KVpop) or `mlp` (KVpop_mlp).
        hidden: readout MLP width.
        memory: mLSTM memory width.
        delayed: mLSTM delayed read (False: the immediate-read ablation).
        labels: the budget and teacher ranking the scorer is trained for.
        tau: τ of the boundary loss.
        steps: optimizer steps.
        batch: sequences per step.
        lr: peak learning rate.
        warmup: linear warmup steps (then cosine decay to lr/10).
        weight_decay: AdamW decoupled weight decay.
        clip: global gradient norm clip.
        eval_every: steps between held-out evaluations (0: only at the end).
        ckpt_every: steps between checkpoints (0: only at the end).
        seed: parameter init and batch order.
    """

    scorer: ScorerKind = ScorerKind.MLSTM
    hidden: int = 32
    memory: int = 16
    delayed: bool = True
    labels: LabelSpec = LabelSpec()
    tau: float = 1.0
    steps: int = 200
    batch: int = 4
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 1e-4
    clip: float = 1.0
    eval_every: int = 50
    ckpt_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        for f in ("steps", "batch"):
            if getattr(self, f) < 1:
                raise ValueError(f"TrainConfig.{f} must be >= 1, got {getattr(self, f)}")
        for f in ("warmup", "eval_every", "ckpt_every"):
            if getattr(self, f) < 0:
                raise ValueError(f"TrainConfig.{f} must be >= 0, got {getattr(self, f)}")
        for f in ("lr", "tau", "clip"):
            if not getattr(self, f) > 0:
                raise ValueError(f"TrainConfig.{f} must be > 0, got {getattr(self, f)}")
        if self.warmup >= self.steps:
            raise ValueError(f"TrainConfig.warmup ({self.warmup}) must be < steps ({self.steps})")

    def scorer_config(self, model: ModelConfig) -> ScorerConfig:
        return ScorerConfig(
            kind=self.scorer,
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            hidden=self.hidden,
            memory=self.memory,
            delayed=self.delayed,
        )

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self), default=_enum_value))


def _enum_value(x: Any) -> Any:
    if isinstance(x, enum.Enum):
        return x.value
    raise TypeError(f"not JSON serializable: {x!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainResult:
    """Attributes: params (the scorer's), history (one dict per step), evals (held-out)."""

    scorer_config: ScorerConfig
    params: Params
    history: list[dict[str, float]]
    evals: list[dict[str, float]]


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup, cfg.steps, end_value=cfg.lr / 10
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip),
        optax.adamw(schedule, weight_decay=cfg.weight_decay),
    )


def batch_indices(step: int, n: int, batch: int, seed: int) -> np.ndarray:
    """The sequences of step `step`: a function of (seed, step) only, so a resumed run sees the
    same batches."""
    if batch > n:
        raise ValueError(f"batch ({batch}) is larger than the {n} training sequences")
    return np.random.default_rng([seed, step]).choice(n, batch, replace=False)


def _functions(cfg: TrainConfig, sc: ScorerConfig, optimizer: optax.GradientTransformation):
    module = make_scorer(sc)
    spec = cfg.labels

    def scores(params, k, v):
        return module.apply({"params": params}, k, v, window=spec.window)

    def loss_fn(params, k, v, labels):
        return boundary_loss(scores(params, k, v), labels, tau=cfg.tau)

    @jax.jit
    def step(params, opt_state, k, v, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, k, v, labels)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes int counts and floats
            updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    @jax.jit
    def evaluate(params, k, v, labels):
        s = scores(params, k, v)
        keep = own_decisions(s, sinks=spec.sinks, window=spec.window, k=spec.k)
        return boundary_loss(s, labels, tau=cfg.tau), agreement(keep, labels)

    return step, evaluate


def train_scorer(
    cfg: TrainConfig,
    model: ModelConfig,
    train: TeacherData,
    held_out: TeacherData | None = None,
    *,
    ckpt_dir: str | pathlib.Path | None = None,
    stop_at: int | None = None,
    progress: bool = False,
) -> TrainResult:
    """Train (or resume, when `ckpt_dir` holds a checkpoint of the same run) a scorer.

    Args:
        cfg: the run.
        model: the teacher model's config (the scorer's shapes).
        train: teacher data of the training sequences.
        held_out: teacher data for evaluation (loss and boundary accuracy), or None.
        ckpt_dir: checkpoint folder; resumes from its latest checkpoint.
        stop_at: stop (with a checkpoint) after this many steps in total, as if interrupted.
        progress: show a progress bar.
    """
    sc = cfg.scorer_config(model)
    optimizer = make_optimizer(cfg)
    step_fn, eval_fn = _functions(cfg, sc, optimizer)
    params = init_scorer_params(sc, jax.random.key(cfg.seed))
    state = {"params": params, "opt_state": optimizer.init(params)}
    history: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    start = 0
    ckpt = Checkpoints(ckpt_dir, cfg.to_json()) if ckpt_dir is not None else None
    try:  # the manager is closed even when restoring or a step fails
        if ckpt is not None and ckpt.latest_step() is not None:
            state, meta = ckpt.restore(state)
            start, history, evals = meta["step"], meta["history"], meta["evals"]
        end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
        steps = range(start, end)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(steps, desc=f"train {sc.kind}", unit="step", initial=start, total=cfg.steps)
            steps = bar

        def run_eval(step: int) -> None:
            if held_out is not None:
                loss, acc = eval_fn(state["params"], held_out.k, held_out.v, held_out.labels)
                evals.append({"step": step, "loss": float(loss), "accuracy": float(acc)})

        for i in steps:
            k, v, labels = train.batch(batch_indices(i, len(train), cfg.batch, cfg.seed))
            p, o, loss, gnorm = step_fn(state["params"], state["opt_state"], k, v, labels)
            state = {"params": p, "opt_state": o}
            history.append({"step": i + 1, "loss": float(loss), "grad_norm": float(gnorm)})
            if bar is not None:
                bar.set_postfix(loss=f"{float(loss):.4f}")
            done = i + 1
            if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                run_eval(done)
            if ckpt is not None and cfg.ckpt_every and done % cfg.ckpt_every == 0 and done < end:
                ckpt.save(done, state, {"history": history, "evals": evals})
        if end == cfg.steps and (not evals or evals[-1]["step"] != end):
            run_eval(end)
        if ckpt is not None and end > start:
            ckpt.save(end, state, {"history": history, "evals": evals})
    finally:
        if ckpt is not None:
            ckpt.close()
    return TrainResult(scorer_config=sc, params=state["params"], history=history, evals=evals)
