"""Strict JAX settings for every test, and shared fixtures.

Eight fake CPU devices (the meshes of tests/sharding), XLA's CPU backend compiling at LLVM -O0
(children such as notebook kernels inherit it), rank promotion raises, dtype promotion
strict, and CPU computations run inline rather than dispatched asynchronously: the Pallas TPU
interpreter's callbacks run jitted code inside a running computation, and with async dispatch
that nested call can wait forever for a slot held by work queued behind it (docs/decisions.md).

One persistent compilation cache per test run: a fresh temporary directory made by the first
process (the xdist controller; its workers inherit the variable) and removed when that process
exits. An executable compiled by one test module is loaded, not compiled again, by a later
module of the same worker (the compile caches in memory are dropped after every module; each
xdist worker writes a subdirectory of its own, since a shared one let a worker read an entry
the other was still writing). It starts empty on every run, so nothing carries over between
runs. KVJAX_TEST_XLA_CACHE=DIR uses (and keeps) DIR instead; KVJAX_TEST_XLA_CACHE=off turns the
cache off.
"""

import atexit
import os
import shutil
import tempfile

# LLVM at -O0 for the CPU executables: the tests' programs are tiny and each is compiled once or
# a few times, so LLVM's optimization passes were a third of their compile time
# (docs/lab/2026-12-01-test-time.md). XLA's HLO passes, which the HLO checks read, are unchanged,
# and fast math stays off (XLA's default).
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if not os.environ.get("KVJAX_TEST_XLA_CACHE"):
    os.environ["KVJAX_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="kvjax-test-xla-")
    atexit.register(shutil.rmtree, os.environ["KVJAX_TEST_XLA_CACHE"], ignore_errors=True)
_BASE = os.environ["KVJAX_TEST_XLA_CACHE"]
# Each xdist worker its own subdirectory: JAX (0.11.2) writes an entry in place, so a worker
# reading an entry the other is still writing saw a truncated file (a warning, an error here).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
XLA_CACHE = os.path.join(_BASE, _WORKER) if _WORKER and _BASE != "off" else _BASE
if XLA_CACHE != "off":
    os.makedirs(XLA_CACHE, exist_ok=True)
# In-process CLI runs (which turn the cache on for themselves) use the same directory, unless
# the user named one (the controller's own setting is inherited: replaced by the worker's).
if os.environ.get("KVJAX_COMPILATION_CACHE", _BASE) == _BASE:
    os.environ["KVJAX_COMPILATION_CACHE"] = XLA_CACHE

import gc  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_cpu_enable_async_dispatch", False)


def _use_test_compilation_cache():
    """Every compile is written (threshold 0: the tiny models compile in well under a second).
    KVJAX_TEST_XLA_CACHE=off runs without it (to measure what it saves)."""
    if XLA_CACHE == "off":
        jax.config.update("jax_enable_compilation_cache", False)
        return
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", XLA_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_use_test_compilation_cache()

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("ci")

GOLDENS = pathlib.Path(__file__).parent / "goldens"


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drop JAX's compile caches after every test module. XLA's CPU JIT keeps ~3 memory mappings
    per compiled object until its executable is freed; a test worker that compiled half the suite
    held ~65K of them, the kernel's limit (vm.max_map_count = 65530), and the next compile
    crashed inside XLA (segfault or abort). Cleared per module, a worker stays at a few
    thousand (docs/decisions.md)."""
    yield
    jax.clear_caches()
    gc.collect()
    _use_test_compilation_cache()  # a CLI test may have turned it off or moved it


@pytest.fixture(autouse=True)
def _llvm_o2_for_real_model_tests(request, monkeypatch):
    """The tests on the real model (the `smollm` fixture, or marked slow) run SmolLM2's 30 layers
    over thousands of tokens: their time is running, not compiling, and at LLVM -O0 they cost a
    third more CPU (docs/lab/2026-12-01-test-time.md). Their executables are compiled at -O2,
    XLA's default, as a per-executable option (the one `jax.jit(compiler_options=)` sets)."""
    if "smollm" in request.fixturenames or request.node.get_closest_marker("slow"):
        from jax._src.interpreters import pxla

        create = pxla.create_compile_options

        def at_o2(computation, tuple_args, to_inputs, to_outputs, backend, devices, options):
            options = {"xla_backend_optimization_level": 2} | dict(options)
            return create(computation, tuple_args, to_inputs, to_outputs, backend, devices, options)

        monkeypatch.setattr(pxla, "create_compile_options", at_o2)
    yield


@pytest.fixture(scope="session")
def goldens() -> pathlib.Path:
    return GOLDENS


@pytest.fixture(scope="session")
def smollm():
    """The embedded default model, loaded once per test session (float32)."""
    from kvjax.weights import load_model

    return load_model()


@pytest.fixture(scope="session")
def tiny_llama():
    from kvjax.models import TINY_LLAMA, init_params

    return TINY_LLAMA, init_params(TINY_LLAMA, jax.random.key(0))


@pytest.fixture(scope="session")
def tiny_gpt2():
    from kvjax.models import TINY_GPT2, init_params

    return TINY_GPT2, init_params(TINY_GPT2, jax.random.key(1))
