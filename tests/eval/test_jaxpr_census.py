"""scripts/jaxpr_census.py counts a jaxpr's chosen primitives by the source line that traced
them, inside nested jaxprs too (a loop's body, a vmapped scatter), and nothing else."""

import inspect
import runpy

import jax
import jax.numpy as jnp

census = runpy.run_path("scripts/jaxpr_census.py")["census"]


def _traced():
    def body(i, a):
        a = a.at[i].set(1.0)  # one scatter, in the loop's body
        return a.at[i + 1].set(2.0)  # another line, another scatter

    def fn(x):
        y = jax.lax.fori_loop(0, 2, body, x)
        z = jax.vmap(lambda r: r.at[0].set(3.0))(jnp.stack([y, y]))  # vmapped: still one
        return jnp.sort(z, axis=-1)  # jitted inside jnp: counted at this line

    return fn, jax.make_jaxpr(fn)(jnp.zeros(4)).jaxpr


def test_counts_each_primitive_at_its_line_in_nested_jaxprs():
    fn, jaxpr = _traced()
    found = census(jaxpr, {"scatter", "sort"})
    src, first = inspect.getsourcelines(fn)
    line = lambda text: next(first + i for i, s in enumerate(src) if text in s)
    body_src, body_first = inspect.getsourcelines(fn.__closure__[0].cell_contents)
    body_line = lambda text: next(body_first + i for i, s in enumerate(body_src) if text in s)
    here = "tests/eval/test_jaxpr_census.py"
    assert found == {
        ("scatter", f"{here}:{body_line('set(1.0)')}"): 1,
        ("scatter", f"{here}:{body_line('set(2.0)')}"): 1,
        ("scatter", f"{here}:{line('set(3.0)')}"): 1,
        ("sort", f"{here}:{line('jnp.sort')}"): 1,
    }


def test_other_primitives_are_not_counted():
    _, jaxpr = _traced()
    assert census(jaxpr, {"cumsum"}) == {}
