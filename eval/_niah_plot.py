"""NIAH outputs: one JSON and one heatmap PNG per (policy, protocol), and a summary table."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._niah import NiahCell, NiahResult


def niah_stem(result: NiahResult) -> str:
    """File name stem, e.g. `full_query-aware`, `window-b256_query-agnostic`, or
    `h2o-r0.5_query-aware` (a compression ratio: a budget per length)."""
    budget = "" if result.budget is None else f"-b{result.budget}"
    ratio = "" if result.ratio is None else f"-r{result.ratio:g}"
    return f"{result.policy}{budget}{ratio}_{result.protocol}"


def niah_score_grid(result: NiahResult) -> np.ndarray:
    """[depths, lengths] float64 scores (NaN where a cell is missing)."""
    grid = np.full((len(result.depths), len(result.lengths)), np.nan)
    for c in result.cells:
        grid[result.depths.index(c.depth), result.lengths.index(c.length)] = c.score
    return grid


def plot_niah_heatmap(result: NiahResult, path: str | pathlib.Path) -> None:
    """Write a heatmap PNG: depths on y, context lengths on x, the score annotated in each cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = niah_score_grid(result)
    fig, ax = plt.subplots(
        figsize=(
            max(4.5, 1.5 + 1.1 * len(result.lengths)),
            max(3.0, 1.8 + 0.5 * len(result.depths)),
        )
    )
    ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i, j in np.ndindex(grid.shape):
        if not np.isnan(grid[i, j]):
            ax.text(j, i, f"{grid[i, j]:.2g}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(result.lengths)), [str(n) for n in result.lengths])
    ax.set_yticks(range(len(result.depths)), [f"{d:g}%" for d in result.depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    budget = "" if result.budget is None else f" budget={result.budget}"
    if result.ratio is not None:
        budget += f" compression={result.ratio:g}"
    ax.set_title(
        f"NIAH: {result.policy}{budget}, {result.protocol}\n{result.model}, "
        f"mean score {result.mean_score:.2f}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_niah_outputs(result: NiahResult, out_dir: str | pathlib.Path) -> tuple[str, str]:
    """Write `<stem>.json` (every cell) and `<stem>.png` under `out_dir`; return both paths."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = niah_stem(result)
    json_path, png_path = out / f"{stem}.json", out / f"{stem}.png"
    json_path.write_text(json.dumps(dataclasses.asdict(result), indent=1) + "\n")
    plot_niah_heatmap(result, png_path)
    return str(json_path), str(png_path)


def read_niah_result(path: str | pathlib.Path) -> NiahResult:
    """A NiahResult back from a JSON file written by `write_niah_outputs`."""
    data = json.loads(pathlib.Path(path).read_text())
    return NiahResult(**{**data, "cells": [NiahCell(**c) for c in data["cells"]]})


def niah_summary_rows(results: Sequence[NiahResult]) -> list[dict[str, Any]]:
    """One row per (policy, protocol): mean score per context length and overall."""
    return [
        {
            "policy": r.policy,
            "budget": r.budget,
            "protocol": r.protocol,
            **({} if r.ratio is None else {"ratio": r.ratio}),
            **{f"L={n}": r.mean_score_by_length[str(n)] for n in r.lengths},
            "mean": r.mean_score,
            "soft": float(np.mean([c.soft_score for c in r.cells])),
        }
        for r in results
    ]
