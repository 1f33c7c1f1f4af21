"""Scorer files: one msgpack file holding the config, free-form metadata and the parameters.

The default scorer for the embedded SmolLM2-135M-Instruct ships inside the package
(`DEFAULT_SCORER`), so the `kvpop` policy works without a training step.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax
import numpy as np
from flax import serialization

from kvjax.scorers._modules import Params, ScorerConfig, init_scorer_params

FORMAT = "kvjax-kvpop-scorer"
VERSION = 1
_DATA = pathlib.Path(__file__).parent / "data"
# Scorers shipped for the embedded SmolLM2-135M-Instruct, by name.
SHIPPED = {
    "mlstm": _DATA / "kvpop_mlstm_smollm2_135m.msgpack",
    "mlp": _DATA / "kvpop_mlp_smollm2_135m.msgpack",
}
DEFAULT_SCORER = SHIPPED["mlstm"]


def save_scorer(
    path: str | pathlib.Path,
    config: ScorerConfig,
    params: Params,
    meta: dict[str, Any] | None = None,
    *,
    dtype: Any = np.float16,
) -> None:
    """Write a scorer file (parameters stored as `dtype`; float16 keeps shipped files small)."""
    cfg = dataclasses.asdict(config) | {"kind": str(config.kind)}
    blob = {
        "format": FORMAT,
        "version": VERSION,
        "config": json.dumps(cfg),
        "meta": json.dumps(meta or {}),
        "params": jax.tree.map(lambda a: np.asarray(a, dtype), dict(params)),
    }
    pathlib.Path(path).write_bytes(serialization.msgpack_serialize(blob))


def resolve_scorer(name_or_path: str | pathlib.Path | None) -> pathlib.Path:
    """A shipped scorer's name (`mlstm`, `mlp`; None = `mlstm`) or a file path → the file."""
    if name_or_path is None:
        return DEFAULT_SCORER
    return SHIPPED.get(str(name_or_path), pathlib.Path(name_or_path))


def load_scorer(
    path: str | pathlib.Path | None = None,
) -> tuple[ScorerConfig, Params, dict[str, Any]]:
    """Read a scorer file → (config, float32 params, metadata).

    Args:
        path: a file, or the name of a shipped scorer (`mlstm`, `mlp`); None = `mlstm`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a scorer file, a newer format, or parameters that do not fit the config.
    """
    path = resolve_scorer(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no scorer file at {path} (shipped scorers: {sorted(SHIPPED)}; train one with "
            "`kvjax train-scorer`)"
        )
    try:
        blob = serialization.msgpack_restore(path.read_bytes())
        ok = isinstance(blob, dict) and blob.get("format") == FORMAT
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ValueError(f"{path} is not a readable kvpop scorer file ({e})") from None
    if not ok:
        raise ValueError(f"{path} is not a kvpop scorer file (format tag {FORMAT!r} missing)")
    version = blob.get("version")
    if version != VERSION:
        raise ValueError(f"{path}: scorer format version {version}, expected {VERSION}")
    try:
        config = ScorerConfig(**json.loads(blob["config"]))
        meta = json.loads(blob["meta"])
        got = blob["params"]
        got_shapes = {k: tuple(np.shape(v)) for k, v in got.items()}
        floats = all(np.asarray(v).dtype.kind == "f" for v in got.values())
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: corrupt scorer file ({type(e).__name__}: {e})") from None
    if not floats:
        raise ValueError(f"{path}: scorer parameters must be floating point arrays")
    want = jax.eval_shape(lambda: init_scorer_params(config, jax.random.key(0)))
    want_shapes = {k: tuple(v.shape) for k, v in want.items()}
    if want_shapes != got_shapes:
        raise ValueError(
            f"{path}: parameters {got_shapes} do not match its config {config} "
            f"(expected {want_shapes})"
        )
    params = {k: np.asarray(v, np.float32) for k, v in got.items()}
    if not all(np.isfinite(v).all() for v in params.values()):
        raise ValueError(f"{path}: scorer parameters hold NaN or Inf")
    return config, params, meta
