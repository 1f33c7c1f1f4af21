"""Shared hypothesis inputs for the quantization tests."""

import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
KINDS = ("normal", "constant", "zeros", "outlier")
LEADS = ((1,), (2, 3))  # T = 1: a group of one token


@st.composite
def inputs(draw):
    """(x [..., T, D] in a float dtype, kind): shapes, magnitudes 1e-3..1e3, adversarial kinds.

    Shapes come from a small menu so that compiled functions are reused across examples.
    """
    shape = (*draw(st.sampled_from(LEADS)), draw(st.sampled_from((1, 8))))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(KINDS))
    mag = 10.0 ** draw(st.floats(-3, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = mag * rng.standard_normal(shape)
    if kind == "constant":
        x = np.full(shape, mag * rng.standard_normal())
    elif kind == "zeros":
        x = np.zeros(shape)
    elif kind == "outlier":
        x.flat[rng.integers(x.size)] = min(1e4 * mag, float(jnp.finfo(dtype).max) / 4)
    return jnp.asarray(x, dtype), kind
