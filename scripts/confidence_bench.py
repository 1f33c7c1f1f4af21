"""Device time of CONF-KV's confidence statistics over one step's logits: `kvjax.policies.
confidence` (chunked reductions, no sort) against the plain form it replaced (log_softmax over
the whole row, then `top_k(logp, 2)`). A debugging aid for the decode step's policy cost.

Usage: python scripts/confidence_bench.py [VOCAB] [BATCH ...]  (default 128256, Llama-3's, at
batches 1 and 8). Prints one JSON line per (form, batch): µs per call, from a jitted loop of
200 calls (each call's input depends on the last, so none is skipped).
"""

import json
import sys
import time

import jax
import jax.numpy as jnp

from kvjax.policies import confidence

CALLS = 200


def plain(logits):
    """The form before chunking: one reduction per statistic over the whole row, and a sort."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
    top2 = jax.lax.top_k(logp, 2)[0]
    return entropy / jnp.log(logits.shape[-1]) + top2[:, 0] - top2[:, 1] + jnp.exp(top2[:, 0])


def chunked(logits):
    c = confidence(logits)
    return c.entropy_norm + c.margin + c.top1


def us_per_call(fn, x) -> float:
    def loop(x):
        body = lambda _, acc: acc + 1e-30 * fn(x + acc[:, None].astype(x.dtype))
        return jax.lax.fori_loop(0, CALLS, body, jnp.zeros(x.shape[0], jnp.float32))

    run = jax.jit(loop)
    run(x).block_until_ready()  # compile
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        run(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best / CALLS * 1e6


def main() -> None:
    vocab = int(sys.argv[1]) if len(sys.argv) > 1 else 128256
    batches = [int(b) for b in sys.argv[2:]] or [1, 8]
    for b in batches:
        x = jax.random.normal(jax.random.key(0), (b, vocab), jnp.float32).astype(jnp.bfloat16)
        for name, fn in (("plain", plain), ("chunked", chunked)):
            us = us_per_call(fn, x)
            row = dict(form=name, batch=b, vocab=vocab, us_per_call=round(us, 2))
            row["device"] = jax.devices()[0].device_kind
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
