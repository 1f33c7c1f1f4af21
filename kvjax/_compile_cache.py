"""JAX's persistent compilation cache for kvjax runs: a second run of the same shapes loads its
compiled executables from disk instead of compiling them again.

The `kvjax` command turns it on before anything compiles; Python users call
`enable_compilation_cache` themselves (importing kvjax changes no JAX setting).
"""

from __future__ import annotations

import os
import pathlib

import jax

ENV_VAR = "KVJAX_COMPILATION_CACHE"
OFF = "off"
# Executables whose compile took less than this are not written (they are cheap to redo and
# would fill the directory with thousands of small entries); JAX's own default is 1 s, which
# leaves out the many 0.2-1 s helpers a CLI run compiles.
MIN_COMPILE_SECONDS = 0.2


def default_cache_dir() -> pathlib.Path:
    """$XDG_CACHE_HOME/kvjax/jax, or ~/.cache/kvjax/jax."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "kvjax" / "jax"


def resolve_cache_dir(location: str | os.PathLike | None = None) -> pathlib.Path | None:
    """Where the cache lives: `location` if given, else $KVJAX_COMPILATION_CACHE, else
    `default_cache_dir()`; None where that is "off" (any case)."""
    if location is None:
        location = os.environ.get(ENV_VAR) or None
    if location is None:
        return default_cache_dir()
    if not isinstance(location, str | os.PathLike):
        raise TypeError(f"compilation cache location must be a path or 'off', got {location!r}")
    text = os.fspath(location)
    if not text.strip():
        raise ValueError("compilation cache location is empty (give a directory or 'off')")
    if text.strip().lower() == OFF:
        return None
    return pathlib.Path(text).expanduser()


def enable_compilation_cache(location: str | os.PathLike | None = None) -> pathlib.Path | None:
    """Turn JAX's persistent compilation cache on (or off) for this process.

    Call it before the first compilation: JAX fixes the cache directory at its first compile.

    Args:
        location: a directory, "off", or None for $KVJAX_COMPILATION_CACHE (a directory or
            "off") and otherwise `default_cache_dir()`.

    Returns:
        The cache directory, or None when the cache is off.

    Raises:
        ValueError: the location is empty, or exists and is not a writable directory.
    """
    path = resolve_cache_dir(location)
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if path.exists() and not path.is_dir():
        raise ValueError(f"compilation cache location {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the compilation cache directory {path}: {e}") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"compilation cache directory {path} is not writable")
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return path


SCAN_XLA_FLAG = "--xla_gpu_enable_triton_gemm=false"


def prefer_cublas_for_scan() -> bool:
    """Adds `SCAN_XLA_FLAG` to $XLA_FLAGS, unless XLA_FLAGS already sets that option.

    In a layer scan each layer's weights are a dynamic slice of the stacked parameters. XLA's
    Triton GEMM fusions take that slice as an operand it must copy, every layer of every step
    (Llama-3-8B, batch 8: 20.1 ms/step against 14.1 with cuBLAS, which reads the slice in place;
    H200, docs/compile.md). The flag is read when JAX starts its GPU backend, so this only acts
    before the first computation; the `kvjax` command calls it for `--scan-layers`. CPU and TPU
    ignore it. Returns whether the flag was added.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if SCAN_XLA_FLAG.partition("=")[0] in flags:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {SCAN_XLA_FLAG}".strip()
    return True
