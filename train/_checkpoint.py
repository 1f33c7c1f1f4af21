"""Orbax checkpoints of a training run: the (params, optimizer state) pytree plus a JSON record of
the run's config, step and loss history, so that a restarted run continues the same trajectory.

The record also holds a SHA-256 digest of the saved arrays and of the record itself: orbax's files
carry no checksum of their own, so a flipped byte in an array chunk or in the JSON would otherwise
restore silently as other numbers."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import pathlib
import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any


def _short(e: Exception) -> str:
    """orbax/TensorStore errors carry the whole store spec: keep the reason, one line."""
    text = str(e).split(" [tensorstore_spec")[0].replace("\n", " ")
    return text if len(text) <= 400 else text[:400] + "…"


def _read(read, where: pathlib.Path, what: str):
    """`read()`, or one ValueError naming the checkpoint, once orbax's other reads of it are
    closed (`_close_stranded_reads`). The error carries the reason as text, not the exception,
    whose traceback would keep those reads alive."""
    try:
        return read()
    except Exception as e:
        reason = _short(e)
    _close_stranded_reads()
    raise ValueError(f"checkpoint {where} is corrupt or unreadable ({what}: {reason})")


def _close_stranded_reads() -> None:
    """After one read fails, orbax leaves its other reads as tasks pending on an event loop it
    has closed: they can never run again, and when one is finally collected (whenever its
    TensorStore future lets go of it) its coroutine turns the GeneratorExit of its closing into
    an exception, an "exception ignored" report at some unrelated later time. Such a task's
    coroutine (orbax's, on a closed loop) is closed here, what that raises dropped, and the
    reports of orbax's coroutines collected meanwhile dropped too (others are passed on)."""
    hook = sys.unraisablehook

    def quiet(report) -> None:
        if "orbax" not in _code_file(report.object):
            hook(report)

    sys.unraisablehook = quiet
    try:
        stranded = [
            t
            for t in gc.get_objects()
            if isinstance(t, asyncio.Task) and not t.done() and t.get_loop().is_closed()
        ]
        for task in stranded:
            coro = task.get_coro()
            if "orbax" in _code_file(coro):
                # orbax's reads re-raise the GeneratorExit as an Exception
                with contextlib.suppress(Exception):
                    coro.close()
        del stranded
        gc.collect()
    finally:
        sys.unraisablehook = hook


def _code_file(coro) -> str:
    code = getattr(coro, "cr_code", None)
    return code.co_filename if code is not None else ""


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
        meta_args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        meta = _read(lambda: self._manager.restore(step, args=meta_args).meta, where, "metadata")
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
        state_args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        state = _read(lambda: self._manager.restore(step, args=state_args).state, where, "arrays")
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
