"""Hostile orbax checkpoints: a training checkpoint with one of its files truncated, bytes flipped
or an 8-byte field overwritten either restores exactly what was saved or raises ONE clear
ValueError/FileNotFoundError naming the checkpoint — never other numbers, another exception, a
hang or a large allocation.

CI runs a few examples; KVJAX_FUZZ_EXAMPLES=1000 runs the recorded campaign
(docs/lab/2026-12-01-fuzzing.md)."""

import asyncio
import gc
import inspect
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reliability.test_fuzz_readers as fz
from hypothesis import given
from hypothesis import strategies as st
from reliability.test_fuzz_readers import FUZZ, mutate, mutations

from kvjax.train._checkpoint import Checkpoints

RUN = {"kind": "mlp", "lr": 1e-3}


def _state():
    k = jax.random.split(jax.random.key(0), 2)
    return {
        "params": {"w": jax.random.normal(k[0], (8, 16)), "b": jnp.zeros(16)},
        "opt": {"mu": jax.random.normal(k[1], (8, 16)), "count": jnp.asarray(7, jnp.int32)},
    }


def save_pristine(root: pathlib.Path) -> tuple[pathlib.Path, list[str]]:
    """A pristine checkpoint folder at `root` and the files in it (relative paths)."""
    ckpt = Checkpoints(root, RUN)
    ckpt.save(5, _state(), {"history": [2.5, 2.25], "evals": []})
    ckpt.close()
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    return root, files


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_pristine(tmp_path_factory.mktemp("ckpt") / "run")


def _restore(root: pathlib.Path):
    ckpt = Checkpoints(root, RUN)
    try:
        return ckpt.restore(_state())
    finally:
        ckpt.close()


def test_a_pristine_checkpoint_restores_what_was_saved(saved):
    root, _ = saved
    state, meta = _restore(root)
    assert meta["step"] == 5 and meta["history"] == [2.5, 2.25]
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(_state()), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# After a failed read orbax leaves its other array reads' coroutines unawaited; their exceptions
# surface at garbage collection as "unraisable" warnings. They are orbax's internals, after our
# one ValueError has been raised, and change nothing restored.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@FUZZ
@given(data=st.data())
def test_checkpoint_reader_on_hostile_files(saved, tmp_path, data):
    root, files = saved
    name = data.draw(st.sampled_from(files))
    run = tmp_path / "run"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(root, run)
    target = run / name
    raw = target.read_bytes()
    target.write_bytes(mutate(raw, data.draw(mutations(len(raw)))))
    restored = []
    fz.check(lambda path: restored.append(_restore(path)), run, str(run))
    for state, meta in restored:  # it loaded: then it is exactly what was saved
        assert meta["step"] == 5 and meta["history"] == [2.5, 2.25]
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(_state()), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_other_array_values_under_the_saved_record_are_caught_by_the_digest(saved, tmp_path):
    """orbax stores array chunks without a checksum: a checkpoint whose arrays differ in one
    value from those its record was written for (what a corrupted chunk amounts to) is refused."""
    root, _ = saved
    state = _state()
    state["params"]["w"] = state["params"]["w"].at[3, 4].add(1.0)
    other = Checkpoints(tmp_path / "run", RUN)
    other.save(5, state, {"history": [2.5, 2.25], "evals": []})
    other.close()
    record = "5/meta/metadata"
    assert (tmp_path / "run" / record).read_bytes() != (root / record).read_bytes()
    shutil.copy(root / record, tmp_path / "run" / record)
    with pytest.raises(ValueError, match="do not match the digest"):
        _restore(tmp_path / "run")


def test_a_failed_read_leaves_none_of_orbax_reads_to_fail_later(saved, tmp_path):
    """A failed restore leaves orbax's other reads as tasks pending on a loop it closed; each
    would raise from its own closing whenever the collector gets to it, in some later test or
    user code. The restore closes them before raising: no orbax coroutine is left suspended on a
    closed loop, and collecting them reports nothing."""
    root, files = saved
    run = tmp_path / "run"
    shutil.copytree(root, run)
    chunk = next(name for name in files if "/state/d/" in name)
    (run / chunk).write_bytes(b"")
    with pytest.raises(ValueError, match="corrupt or unreadable"):
        _restore(run)
    stranded = [
        t.get_coro()
        for t in gc.get_objects()
        if isinstance(t, asyncio.Task) and not t.done() and t.get_loop().is_closed()
    ]
    suspended = [
        c
        for c in stranded
        if "orbax" in c.cr_code.co_filename
        and inspect.getcoroutinestate(c) == inspect.CORO_SUSPENDED
    ]
    assert not suspended
    del stranded, suspended
    reports = []
    hook, sys.unraisablehook = sys.unraisablehook, reports.append
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert [str(r.object) for r in reports if "orbax" in str(r.object)] == []
