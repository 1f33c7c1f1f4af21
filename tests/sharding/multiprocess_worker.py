"""One process of the 2-process CPU test: `python multiprocess_worker.py PORT PROCESS_ID OUT`.

Joins JAX's multi-controller runtime over gloo, builds the 2x2 (data x model) mesh over both
processes' devices, generates with the same arguments as every other process and writes the
gathered tokens to OUT as JSON."""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)

from jax.experimental import multihost_utils  # noqa: E402
from policy_cases import build  # noqa: E402
from sharding_cases import CONFIG8, PROMPTS  # noqa: E402

from kvjax.generate import GenerateConfig, generate  # noqa: E402
from kvjax.models import init_params  # noqa: E402
from kvjax.sharding import make_mesh  # noqa: E402

assert jax.process_count() == 2 and len(jax.devices()) == 4, (jax.process_count(), jax.devices())
params = init_params(CONFIG8, jax.random.key(0))
gen = GenerateConfig(max_new_tokens=6, chunk_size=32, implementation="xla")
res = generate(
    CONFIG8, params, PROMPTS, policy=build("h2o", 16), gen=gen, mesh=make_mesh(data=2, model=2)
)
tokens = multihost_utils.process_allgather(res.tokens, tiled=True)
with open(out, "w") as f:
    json.dump({"tokens": tokens.tolist(), "local_devices": jax.local_device_count()}, f)
jax.distributed.shutdown()
