"""Rules that map logical axes onto mesh axes, and the layout they resolve to for one model.

`ShardingRules` is data: which mesh axis (if any) each logical axis is split over. `Layout` is
the rules resolved against a concrete `Mesh`, model and batch: an axis whose size does not
divide its mesh axis is replicated by the documented rule (`resolve_layout`), so every array's
`PartitionSpec` is known before anything is traced. Both are frozen and hashable (a static jit
argument: one compilation per layout).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from kvjax.sharding._axes import Axis, Names

DATA, MODEL, SEQ = "data", "model", "seq"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingRules:
    """Mesh axis per logical axis (None: replicated).

    Attributes:
        batch: sequences (data parallel).
        heads: query heads *and* KV heads, one axis for both so every device holds the query
            heads of its KV heads (Megatron attention split; XLA adds the all-reduce after the
            output projection).
        mlp: the MLP hidden width (Megatron MLP split; an all-reduce after the down projection).
        vocab: the vocabulary of the embedding / output head (logits arrive vocab-sharded).
        slots: the slot axis of every cache tier (context-parallel decode; partial attention
            merges by log-sum-exp across it).
    """

    batch: str | None = DATA
    heads: str | None = MODEL
    mlp: str | None = MODEL
    vocab: str | None = MODEL
    slots: str | None = None

    def __post_init__(self) -> None:
        used = [a for a in (self.batch, self.heads, self.slots) if a is not None]
        if len(set(used)) != len(used):
            raise ValueError(
                f"ShardingRules: batch, heads and slots must use different mesh axes, "
                f"got batch={self.batch!r}, heads={self.heads!r}, slots={self.slots!r}"
            )

    def mesh_axes(self) -> tuple[str, ...]:
        """The mesh axes these rules name."""
        named = (self.batch, self.heads, self.mlp, self.vocab, self.slots)
        return tuple(dict.fromkeys(a for a in named if a is not None))


TENSOR_PARALLEL = ShardingRules()  # batch over data; heads, MLP, vocab over model
# Batch-1 long contexts: the cache's slot axis over seq (heads, MLP, vocab still over model).
CONTEXT_PARALLEL = ShardingRules(batch=None, slots=SEQ)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """Rules resolved for one mesh, model and batch: the mesh axis of each logical axis.

    Attributes:
        mesh: the device mesh (its axes typed Auto: XLA propagates shardings).
        axes: (logical axis, mesh axis) pairs of every sharded logical axis.
    """

    mesh: Mesh
    axes: tuple[tuple[Axis, str], ...]

    def mesh_axis(self, axis: Axis | None) -> str | None:
        return dict(self.axes).get(axis) if axis is not None else None

    def spec(self, names: Names) -> PartitionSpec:
        """The PartitionSpec of an array named `names`, in the canonical form jitted functions
        return their outputs in: a mesh axis of size 1 (it splits nothing) is None and trailing
        Nones are dropped. Inputs placed by any other (equivalent) spec come back from a step
        with this one, so feeding a step's cache back would miss its compiled executable and
        compile again (docs/lab/2026-12-01-mesh-one-gpu.md)."""
        axes = [self.mesh_axis(a) for a in names.axes]
        axes = [a if a is not None and self.mesh.shape[a] > 1 else None for a in axes]
        while axes and axes[-1] is None:
            axes.pop()
        return PartitionSpec(*axes)

    def sharding(self, names: Names) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(names))

    def axis_size(self, axis: Axis) -> int:
        name = self.mesh_axis(axis)
        return 1 if name is None else self.mesh.shape[name]


def auto_mesh(mesh: Mesh) -> Mesh:
    """`mesh` with every axis typed Auto (kvjax annotates and lets XLA propagate; Explicit axes
    would make every jnp op check shardings in its types)."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def make_mesh(**axes: int) -> Mesh:
    """A mesh over the first prod(sizes) devices, e.g. `make_mesh(data=2, model=4)`.

    Raises:
        ValueError: a size < 1, or more devices asked for than exist.
    """
    import jax

    if not axes or min(axes.values()) < 1:
        raise ValueError(f"mesh axis sizes must be >= 1, got {axes}")
    n = int(np.prod(list(axes.values())))
    devices = jax.devices()
    if n > len(devices):
        raise ValueError(f"mesh {axes} needs {n} devices, {len(devices)} available")
    grid = np.asarray(devices[:n], dtype=object).reshape(tuple(axes.values()))
    return Mesh(grid, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def resolve_layout(
    mesh: Mesh,
    rules: ShardingRules,
    *,
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    slot_counts: tuple[int, ...] = (),
) -> Layout:
    """Resolve `rules` on `mesh` for one model and batch.

    Replication rule (docs/decisions.md, "Sharding: what does not divide"): heads whose KV-head
    count (or query-head count) does not divide the heads axis are replicated (query and KV
    heads together, e.g. SmolLM2's 3 KV heads on model=2); likewise the MLP width and the
    vocabulary each replicate alone. Batch and slots never silently replicate: the caller chose
    them, so a size that does not divide is an error.

    Args:
        slot_counts: every cache tier's slot (page) count per layer, checked against `slots`.

    Raises:
        ValueError: a rule names an axis the mesh lacks, or batch / slots do not divide.
    """
    mesh = auto_mesh(mesh)
    for name in rules.mesh_axes():
        if name not in mesh.shape:
            raise ValueError(
                f"sharding rules name mesh axis {name!r}, mesh has {tuple(mesh.axis_names)}"
            )
    size = lambda name: 1 if name is None else mesh.shape[name]
    if batch % size(rules.batch):
        raise ValueError(
            f"batch {batch} does not divide mesh axis {rules.batch!r} "
            f"(size {size(rules.batch)}); pad the batch or use a smaller {rules.batch!r} axis"
        )
    bad = [c for c in slot_counts if c % size(rules.slots)]
    if bad:
        raise ValueError(
            f"cache slot counts {sorted(set(bad))} do not divide mesh axis {rules.slots!r} "
            f"(size {size(rules.slots)}); choose budgets that are multiples of it"
        )
    axes: list[tuple[Axis, str]] = []
    if rules.batch is not None:
        axes.append((Axis.BATCH, rules.batch))
    heads = size(rules.heads)
    if rules.heads is not None and not (num_kv_heads % heads or num_heads % heads):
        axes += [(Axis.HEADS, rules.heads), (Axis.KV_HEADS, rules.heads)]
    if rules.mlp is not None and not intermediate_size % size(rules.mlp):
        axes.append((Axis.MLP, rules.mlp))
    if rules.vocab is not None and not vocab_size % size(rules.vocab):
        axes.append((Axis.VOCAB, rules.vocab))
    if rules.slots is not None:
        axes.append((Axis.SLOTS, rules.slots))
    return Layout(mesh=mesh, axes=tuple(axes))
