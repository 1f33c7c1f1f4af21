"""Strict JAX settings for every test, and shared fixtures.

Eight fake CPU devices (the meshes of tests/sharding), rank promotion raises, dtype promotion
strict, and CPU computations run inline rather than dispatched asynchronously: the Pallas TPU
interpreter's callbacks run jitted code inside a running computation, and with async dispatch
that nested call can wait forever for a slot held by work queued behind it (docs/decisions.md).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KVJAX_COMPILATION_CACHE", "off")  # tests compile afresh, write nothing

import gc  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_cpu_enable_async_dispatch", False)

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
