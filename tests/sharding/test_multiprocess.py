"""The same `generate(..., mesh=)` under JAX's multi-controller runtime: two local CPU processes
(gloo collectives, a coordinator on a free localhost port) generate the one-process tokens."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
from policy_cases import build
from sharding_cases import PROMPTS

from kvjax.generate import GenerateConfig, generate

WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_generate_the_one_process_tokens(model8, tmp_path):
    port = _free_port()
    env = os.environ | {"PYTHONPATH": str(WORKER.parent.parent)}
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(i), str(outs[i])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        finally:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    config, params = model8
    gen = GenerateConfig(max_new_tokens=6, chunk_size=32, implementation="xla")
    ref = generate(config, params, PROMPTS, policy=build("h2o", 16), gen=gen)
    for out in outs:
        got = json.loads(out.read_text())
        assert got["local_devices"] == 2  # each process holds half the 2x2 mesh
        np.testing.assert_array_equal(np.asarray(got["tokens"]), np.asarray(ref.tokens))
