"""The GPU shaping of decode GEMMs (`project`, `separate`) computes what the plain dots do.

The GPU branches are taken on the CPU here by patching the backend check: they are pure
reshapes, padding and optimization barriers, so their results must equal `einsum_f32`'s (and
the float64 product) on any device. What they change on a GPU (no weight conversions or
concatenations in the compiled step) is measured in docs/lab/2026-12-04-h200-decode-gemms.md.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import _numerics
from kvjax._numerics import einsum_f32, project, separate


@pytest.fixture(params=[False, True], ids=["cpu-path", "gpu-path"])
def gpu_path(request, monkeypatch):
    monkeypatch.setattr(_numerics, "_gpu", lambda: request.param)
    return request.param


@pytest.mark.parametrize("lead", [(), (1,), (1, 1), (3,), (2, 5)])
@pytest.mark.parametrize("transposed", [False, True])
def test_project_is_the_float64_product(gpu_path, lead, transposed):
    rng = np.random.default_rng(len(lead) * 2 + transposed)
    x = rng.standard_normal((*lead, 24))
    w = rng.standard_normal((24, 40))
    wt = w.T if transposed else w
    got = jax.jit(lambda a, b: project(a, b, w_transposed=transposed))(
        jnp.asarray(x, jnp.float32), jnp.asarray(wt, jnp.float32)
    )
    assert got.shape == (*lead, 40) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), x @ w, rtol=2e-5, atol=2e-5)


def test_project_equals_einsum_f32_in_bfloat16(gpu_path):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((1, 1, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(project)(x, w)),
        np.asarray(jax.jit(lambda a, b: einsum_f32("...i,io->...o", a, b))(x, w)),
    )


@pytest.mark.parametrize("rows", [1, 8, _numerics.FEW_ROWS + 1])
def test_separate_gives_n_equal_copies(gpu_path, rows):
    x = jnp.arange(rows * 6, dtype=jnp.float32).reshape(rows, 6)
    outs = jax.jit(lambda a: separate(a, 3))(x)
    assert len(outs) == 3
    for o in outs:
        np.testing.assert_array_equal(np.asarray(o), np.asarray(x))


def test_separate_hides_the_shared_operand_on_the_gpu_path(gpu_path):
    """The copies are distinct values to XLA (an optimization barrier) only where it matters."""
    text = jax.jit(lambda a: separate(a, 2)).lower(jnp.ones((2, 4))).as_text()
    assert ("optimization_barrier" in text) == gpu_path
