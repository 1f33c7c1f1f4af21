"""Where a policy's decode loop gets its costly primitives: the jaxpr of `bench decode`'s loop
(`_decode`, the layer scan over a stacked cache) walked into every sub-jaxpr, each equation of
the named primitives counted by the kvjax source line that traced it. A kernel-count aid: on
XLA:CPU each scatter, gather, sort or transpose of a step mostly ends as a kernel of its own,
and the compiled HLO keeps no source lines to say whose it is.

Usage: python scripts/jaxpr_census.py POLICY [POLICY ...] [--prims scatter,gather,...]
       [--preset SmolLM2-135M] [--budget 256] [--context 1024]
Prints "count primitive file:line" per policy, sorted by primitive then place.
"""

from __future__ import annotations

import argparse
import collections
import os

import jax
import jax.numpy as jnp
from jax._src import source_info_util
from jax.extend.core import jaxprs_in_params

from kvjax.eval._bench import _decode, policy_from_spec
from kvjax.generate import new_cache
from kvjax.models import PRESETS, init_params, stack_params

PRIMS = "scatter,scatter-add,gather,sort,transpose,div,cumsum,argmax,argmin"


def census(jaxpr, prims: set[str]) -> collections.Counter:
    """(primitive, "file:line") → equations, over jaxpr and every jaxpr nested in it."""
    seen: collections.Counter = collections.Counter()

    def walk(j, outer: str) -> None:
        for e in j.eqns:
            # An equation traced inside a library function that is jitted itself (jnp.sort,
            # take_along_axis) has no user frame of its own: it takes its caller's line.
            frame = source_info_util.user_frame(e.source_info.traceback)
            where = (
                outer if frame is None else f"{os.path.relpath(frame.file_name)}:{frame.start_line}"
            )
            if e.primitive.name in prims:
                seen[(e.primitive.name, where)] += 1
            for sub in jaxprs_in_params(e.params):
                walk(sub, where)

    walk(jaxpr, "?")
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("policy", nargs="+")
    p.add_argument("--prims", default=PRIMS, help="comma-separated primitive names")
    p.add_argument("--preset", default="SmolLM2-135M")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    a = p.parse_args()
    if a.preset not in PRESETS:
        raise SystemExit(f"unknown preset {a.preset!r}; choose one of {', '.join(PRESETS)}")
    config = PRESETS[a.preset]
    params = stack_params(init_params(config, jax.random.key(0), dtype=jnp.float32), config)
    prims = set(a.prims.split(","))
    tok = jnp.zeros((1,), jnp.int32)
    for spec in a.policy:
        pol = policy_from_spec(spec, a.budget, config.num_layers)
        cache = new_cache(config, pol, batch=1, max_len=a.context, dtype=jnp.float32, stacked=True)
        step = lambda prm, c, t, pol=pol: _decode.__wrapped__(config, pol, 1, "xla", prm, c, t)
        found = census(jax.make_jaxpr(step)(params, cache, tok).jaxpr, prims)
        print(f"{spec}: {sum(found.values())} equations")
        for (prim, where), n in sorted(found.items()):
            print(f"  {n:3d} {prim:12s} {where}")


if __name__ == "__main__":
    main()
