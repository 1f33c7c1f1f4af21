"""kvjax.eval._profile: per-kernel device times from a profiler trace."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from kvjax.eval._profile import device_kernel_times, find_trace, kernel_table, step_timeline


def _write(path, events):
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_device_kernel_times_sums_device_rows_only(tmp_path):
    meta = lambda pid, name: {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
    x = lambda pid, name, dur: {"ph": "X", "pid": pid, "tid": 1, "ts": 0, "dur": dur, "name": name}
    events = [meta(1, "/host:CPU"), meta(7, "/device:GPU:0"), meta(8, "/device:GPU:0 (stream)")]
    events += [x(7, "fusion_1", 2.0), x(7, "fusion_1", 3.0), x(8, "reduce_2", 4.5)]
    events += [x(1, "fusion_1", 100.0), {"ph": "i", "pid": 7, "name": "fusion_1"}]
    path = tmp_path / "perfetto_trace.json.gz"
    _write(path, events)
    times = device_kernel_times(str(path))
    assert times == {"fusion_1": (5.0, 2), "reduce_2": (4.5, 1)}
    table = kernel_table(times, steps=1)
    assert table.splitlines()[0] == "3.0 launches, 9.5 us of kernels per step"
    assert "fusion_1" in table.splitlines()[1]  # largest first


def test_no_device_rows_and_no_trace_are_clear_errors(tmp_path):
    path = tmp_path / "perfetto_trace.json.gz"
    _write(path, [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}])
    with pytest.raises(ValueError, match="no /device:GPU"):
        device_kernel_times(str(path))
    with pytest.raises(FileNotFoundError, match="perfetto_trace"):
        find_trace(str(tmp_path / "empty"))


def test_a_real_trace_parses(tmp_path):
    """A trace JAX writes on this machine: its host rows parse the same way (CPU runs have no
    device rows; the GPU ones are read by the same code)."""
    f = jax.jit(lambda x: jnp.sum(jnp.sin(x)))
    f(jnp.ones(64)).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        f(jnp.ones(64)).block_until_ready()
    times = device_kernel_times(find_trace(str(tmp_path)), device="/host:CPU")
    assert times and all(us >= 0 and n >= 1 for us, n in times.values())


def test_step_timeline_merges_runs_and_shows_idle_gaps(tmp_path):
    meta = {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}
    x = lambda ts, dur, name: {"ph": "X", "pid": 7, "tid": 1, "ts": ts, "dur": dur, "name": name}
    # two steps, each: 2 copies, a 50 us idle gap (a sync), a reduce, then the write (marker)
    events = [meta]
    for t in (0.0, 1000.0):
        events += [x(t, 1, "copy"), x(t + 1, 1, "copy"), x(t + 52, 10, "reduce")]
        events += [x(t + 62, 5, "write")]
    path = tmp_path / "perfetto_trace.json.gz"
    _write(path, events)
    lines = step_timeline(str(path), "write").splitlines()
    # the step runs from the first copy after the first write to the second write's end
    assert lines[0] == "step: 67.0 us, 17.0 us busy, 4 launches"
    assert [ln.split()[-1] for ln in lines[1:]] == ["copy", "reduce", "write"]
    assert "2 x      2.0 us" in lines[1]
    assert "idle   50.0" in lines[2] and "idle    0.0" in lines[3]
    with pytest.raises(ValueError, match="'nope' ran 0 times"):
        step_timeline(str(path), "nope")
