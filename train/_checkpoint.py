"""Orbax checkpoints of a training run: the (params, optimizer state) pytree plus a JSON record of
the run's config, step and loss history, so that a restarted run continues the same trajectory.

The record also holds a SHA-256 digest of the saved arrays and of the record itself: orbax's files
carry no checksum of their own, so a flipped byte in an array chunk or in the JSON would otherwise
restore silently as other numbers."""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any


def _short(e: Exception) -> str:
    """orbax/TensorStore errors carry the whole store spec: keep the reason, one line."""
    text = str(e).split(" [tensorstore_spec")[0].replace("\n", " ")
    return text if len(text) <= 400 else text[:400] + "…"


def state_digest(state: PyTree, record: dict[str, Any]) -> str:
    """SHA-256 over the JSON record (canonical form) and every leaf's path, dtype, shape and
    bytes (host copies, C order)."""
    h = hashlib.sha256(json.dumps(record, sort_keys=True).encode())
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


class Checkpoints:
    """Save and restore a run under `directory` (one sub-folder per step, the last `keep` kept).

    Args:
        directory: the run's checkpoint folder (created if missing).
        run_config: JSON-ready dict of everything that must match on resume.
        keep: how many checkpoints to keep.
    """

    def __init__(self, directory: str | pathlib.Path, run_config: dict[str, Any], *, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = pathlib.Path(directory).absolute()
        self.run_config = run_config
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: PyTree, record: dict[str, Any]) -> None:
        """Write `state` (arrays) and `record` (JSON: history etc.) as checkpoint `step`."""
        meta = {"config": self.run_config, "step": step, **record}
        meta["digest"] = state_digest(state, meta)
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self._manager.save(step, args=args, force=True)
        self._manager.wait_until_finished()

    def restore(self, like: PyTree, step: int | None = None) -> tuple[PyTree, dict[str, Any]]:
        """Read checkpoint `step` (default: the latest) shaped like `like`.

        Raises:
            FileNotFoundError: no checkpoint in the folder.
            ValueError: the checkpoint was written by a run with another config, or is corrupt.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        where = self.directory / str(step)
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = meta.meta
        except Exception as e:
            raise ValueError(
                f"checkpoint {where} is corrupt or unreadable (metadata: {_short(e)})"
            ) from e
        if not isinstance(meta, dict) or "config" not in meta or "step" not in meta:
            raise ValueError(f"checkpoint {where} is corrupt: its metadata has no config/step")
        diff = {
            k: (meta["config"].get(k), v)
            for k, v in self.run_config.items()
            if meta["config"].get(k) != v
        }
        if diff:
            fields = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"checkpoint {where} belongs to a different run ({fields}); use another "
                "--ckpt-dir or the same settings"
            )
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        try:
            state = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
            ).state
        except Exception as e:
            raise ValueError(
                f"checkpoint {where} is corrupt or unreadable (arrays: {_short(e)})"
            ) from e
        got = jax.tree.map(lambda a: (a.shape, a.dtype), state)
        want = jax.tree.map(lambda a: (a.shape, a.dtype), like)
        if jax.tree.structure(state) != jax.tree.structure(like) or got != want:
            raise ValueError(f"checkpoint {where} holds arrays of other shapes than this run's")
        digest = meta.pop("digest", None)
        if digest != state_digest(state, meta):
            raise ValueError(
                f"checkpoint {where} is corrupt: its arrays or record do not match the digest "
                "written at save"
            )
        return state, meta

    def close(self) -> None:
        self._manager.close()
