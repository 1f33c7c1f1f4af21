"""Per-kernel device times from a JAX profiler trace (`jax.profiler.trace(dir,
create_perfetto_trace=True)`): where a compiled step's time goes, kernel by kernel, without
Nsight Compute (which crashed on the policy probe on the H200, docs/benchmarks.md session 7)."""

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


def device_kernel_times(path: str, device: str = "/device:GPU") -> dict[str, tuple[float, int]]:
    """{kernel name: (total µs, launches)} over the complete events ("ph": "X") of the trace's
    processes whose name starts with `device` (the accelerator's kernel rows; host rows are
    left out). Raises if the trace has no such process (a CPU-only run has none)."""
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
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in procs:
            acc = out[e["name"]]
            acc[0] += float(e.get("dur", 0.0))
            acc[1] += 1
    return {name: (us, int(n)) for name, (us, n) in out.items()}


def kernel_table(times: dict[str, tuple[float, int]], steps: int) -> str:
    """A readable table, per step: µs, launches and µs per launch of each kernel, largest
    first, and the total."""
    total = sum(us for us, _ in times.values())
    launches = sum(n for _, n in times.values())
    lines = [f"{launches / steps:.1f} launches, {total / steps:.1f} us of kernels per step"]
    for name, (us, n) in sorted(times.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{us / steps:9.2f} us {n / steps:7.2f} x {us / n:7.2f} us  {name[:90]}")
    return "\n".join(lines)
