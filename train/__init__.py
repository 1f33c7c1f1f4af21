"""Training of the learned KVpop eviction scorer (installed as `kvjax.train`; METHODS.md, "KVpop").

Teacher activations of the frozen model → log future attention mass per key (transposed pass) →
boundary pairwise logistic loss on a Flax scorer (`kvjax.scorers`) → optax loop with orbax
checkpoints. `kvjax train-scorer` runs it all.
"""

from kvjax.train._checkpoint import Checkpoints
from kvjax.train._data import (
    HELD_OUT_ESSAYS,
    EssaySplit,
    LabelSpec,
    TeacherData,
    build_teacher_data,
    split_essays,
    token_windows,
)
from kvjax.train._evaluate import BoundaryAccuracy, boundary_accuracy
from kvjax.train._loop import (
    TrainConfig,
    TrainResult,
    batch_indices,
    make_optimizer,
    train_scorer,
)
from kvjax.train._loss import (
    BoundaryLabels,
    Weighting,
    agreement,
    boundary_labels,
    boundary_loss,
    dynamic_decisions,
    own_decisions,
    running_boundaries,
)
from kvjax.train._report import plot_loss_curve, write_json
from kvjax.train._targets import HeadAggregate, dense_log_future_mass, log_future_mass
from kvjax.train._teacher import Teacher, accumulated_mass, teacher_activations

__all__ = [
    "HELD_OUT_ESSAYS",
    "BoundaryAccuracy",
    "BoundaryLabels",
    "Checkpoints",
    "EssaySplit",
    "HeadAggregate",
    "LabelSpec",
    "Teacher",
    "TeacherData",
    "TrainConfig",
    "TrainResult",
    "Weighting",
    "accumulated_mass",
    "agreement",
    "batch_indices",
    "boundary_accuracy",
    "boundary_labels",
    "boundary_loss",
    "build_teacher_data",
    "dense_log_future_mass",
    "dynamic_decisions",
    "log_future_mass",
    "make_optimizer",
    "own_decisions",
    "plot_loss_curve",
    "running_boundaries",
    "split_essays",
    "teacher_activations",
    "token_windows",
    "train_scorer",
    "write_json",
]
