"""Per-kernel device times from a JAX profiler trace (`jax.profiler.trace(dir,
create_perfetto_trace=True)`): where a compiled step's time goes, kernel by kernel, without
Nsight Compute (which crashed on the H200 policy probe, docs/lab/2026-11-30-kernels-vwords.md)."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os


def find_trace(log_dir: str) -> str:
    """The newest perfetto_trace.json.gz under a profiler log directory."""
    found = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not found:
        raise FileNotFoundError(
            f"no perfetto_trace.json.gz under {log_dir} (was the trace taken with "
            "create_perfetto_trace=True?)"
        )
    return max(found, key=os.path.getmtime)


def _device_events(path: str, device: str) -> list[dict]:
    """The complete events ("ph": "X") of the trace's processes whose name starts with `device`
    (the accelerator's kernel rows; host rows are left out), by start time. Raises if the trace
    has no such process (a CPU-only run has none)."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and str(e.get("args", {}).get("name", "")).startswith(device)
    }
    if not procs:
        raise ValueError(f"{path}: no {device}* process in the trace")
    found = [e for e in events if e.get("ph") == "X" and e.get("pid") in procs]
    return sorted(found, key=lambda e: float(e["ts"]))


def device_kernel_times(path: str, device: str = "/device:GPU") -> dict[str, tuple[float, int]]:
    """{kernel name: (total µs, launches)} over the trace's device rows (`_device_events`)."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in _device_events(path, device):
        acc = out[e["name"]]
        acc[0] += float(e.get("dur", 0.0))
        acc[1] += 1
    return {name: (us, int(n)) for name, (us, n) in out.items()}


def step_timeline(path: str, marker: str, device: str = "/device:GPU") -> str:
    """One step of a loop on the device, as a readable timeline: the kernels after the
    second-to-last launch of `marker` (the step's last kernel) up to and including the last,
    consecutive launches of one kernel merged into a run, each run with its start, the idle
    time before it (host launch gaps and syncs show here, not in kernel times), its count and
    its busy µs; first line: the step's span and busy time. Raises if `marker` ran < 2 times."""
    events = _device_events(path, device)
    marks = [i for i, e in enumerate(events) if e["name"] == marker]
    if len(marks) < 2:
        raise ValueError(f"{path}: {marker!r} ran {len(marks)} times; a step needs 2")
    step = events[marks[-2] + 1 : marks[-1] + 1]
    t0 = float(step[0]["ts"])
    end = lambda e: float(e["ts"]) + float(e.get("dur", 0.0))
    busy = sum(float(e.get("dur", 0.0)) for e in step)
    lines = [f"step: {end(step[-1]) - t0:.1f} us, {busy:.1f} us busy, {len(step)} launches"]
    runs: list[list] = []  # [name, count, busy, start, end]
    for e in step:
        if runs and runs[-1][0] == e["name"]:
            runs[-1][1] += 1
            runs[-1][2] += float(e.get("dur", 0.0))
            runs[-1][4] = end(e)
        else:
            runs.append([e["name"], 1, float(e.get("dur", 0.0)), float(e["ts"]), end(e)])
    last = t0
    for name, n, us, start, stop in runs:
        gap = max(0.0, start - last)
        lines.append(f"{start - t0:9.1f} us  idle {gap:6.1f}  {n:4d} x {us:8.1f} us  {name[:70]}")
        last = max(last, stop)
    return "\n".join(lines)


def kernel_table(times: dict[str, tuple[float, int]], steps: int) -> str:
    """A readable table, per step: µs, launches and µs per launch of each kernel, largest
    first, and the total."""
    total = sum(us for us, _ in times.values())
    launches = sum(n for _, n in times.values())
    lines = [f"{launches / steps:.1f} launches, {total / steps:.1f} us of kernels per step"]
    for name, (us, n) in sorted(times.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{us / steps:9.2f} us {n / steps:7.2f} x {us / n:7.2f} us  {name[:90]}")
    return "\n".join(lines)
