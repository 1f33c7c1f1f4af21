"""The sharded decode path on one device against the unsharded one: same shapes, one run each.

    python scripts/compare_mesh.py --preset Llama-3-8B --policy h2o --budget 2048 \
        --context 8192 --batch 8 --dtype bfloat16 --attention auto

Prints one JSON object (both rows of `kvjax bench decode` and sharded / unsharded ms per step)
and progress on stderr. `--mesh` defaults to data=1,model=1: every array is placed on a
one-device mesh and the kernels run under shard_map, so any gap is the sharded path's own cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp

from kvjax.eval import bench_decode
from kvjax.eval._bench_mesh import parse_mesh
from kvjax.models import PRESETS, init_params
from kvjax.policies import BUDGETLESS, make_policy
from kvjax.sharding import make_mesh


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="SmolLM2-135M", choices=list(PRESETS))
    p.add_argument("--policy", default="h2o")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--attention", default="auto")
    p.add_argument("--mesh", default="data=1,model=1")
    args = p.parse_args(argv)
    config = PRESETS[args.preset]
    params = init_params(config, jax.random.key(0), dtype=jnp.dtype(args.dtype))
    budget = None if args.policy in BUDGETLESS else args.budget
    policy = make_policy(args.policy, budget, num_layers=config.num_layers)
    rows = {}
    for name, mesh in (("unsharded", None), ("mesh", make_mesh(**parse_mesh(args.mesh)))):
        print(f"{name}: filling {args.context} tokens and timing", file=sys.stderr, flush=True)
        r = bench_decode(
            config, params, policy, context=args.context, batch=args.batch, steps=args.steps,
            budget=budget, implementation=args.attention, fill_chunk=min(512, args.context),
            progress=True, mesh=mesh,
        )  # fmt: skip
        rows[name] = dataclasses.asdict(r)
    ratio = rows["mesh"]["ms_per_step"] / rows["unsharded"]["ms_per_step"]
    print(json.dumps({"sharded_over_unsharded": ratio, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
