"""Where a whole decode step goes: every kernel's device time per step of `bench decode`'s
jitted loop (model + attention + the policy's write), from a JAX profiler trace. A debugging aid.

Usage: TRACE=DIR python scripts/profile_decode.py LAYERS POLICY:BUDGET [BATCH] [KNOB=V ...]
Random-init Llama-3-8B shapes cut to LAYERS layers (PRESET=NAME: another preset), BF16, 32K
context (CONTEXT=N) filled with random tokens, Pallas attention. KNOB=V overrides a field of
this device's decode-kernel `Tuning` (e.g. lowbit_stack_pages=0; a tuple field
takes "+"-separated ints, lowbit_int8_qk_bits=4+2): an A/B of a default inside the
whole step. STACKED=1 profiles the layer-scan step (`--scan-layers`: stacked cache and params)
instead of the unrolled one, e.g. to see where batch 1's scanned step loses its time.
POLICY_SET="group=64,lowbit_layout=kernel" sets policy hyperparameters (as `--set`).
HLO=FILE writes the compiled step's optimized HLO there (what each traced kernel fuses).
"""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

from kvjax.cache import stack_cache
from kvjax.eval._bench import _decode, fill_random, policy_from_spec, second_call_seconds
from kvjax.eval._profile import device_kernel_times, find_trace, kernel_table
from kvjax.generate import new_cache
from kvjax.models import PRESETS, init_params, stack_params
from kvjax.pallas_kernels.decode_attention import _tuning

STEPS = 8


def main() -> None:
    args = sys.argv[1:]
    knobs = dict(a.split("=") for a in args if "=" in a)
    pos = [a for a in args if "=" not in a]
    if len(pos) not in (2, 3) or ":" not in pos[1]:
        raise SystemExit(__doc__)
    layers, (name, budget) = int(pos[0]), pos[1].split(":")
    batch = int(pos[2]) if len(pos) == 3 else 8
    kind = jax.devices()[0].device_kind
    # KNOB=V as KVJAX_TUNING's field=value (tuples "+"-separated: mgpu_tiers=full-tm+int8,
    # lowbit_int8_qk_bits=4+2); a bad field or value is one error naming it.
    try:
        tune = _tuning._overrides(",".join(f"{k}={v}" for k, v in knobs.items()),
                                  _tuning.tuning_for(kind))  # fmt: skip
    except ValueError as e:
        raise SystemExit(str(e).replace(_tuning.ENV, "KNOB=V")) from None
    _tuning.TUNINGS[kind] = tune
    cfg = dataclasses.replace(PRESETS[os.environ.get("PRESET", "Llama-3-8B")], num_layers=layers)
    ctx = int(os.environ.get("CONTEXT", "32768"))
    params = init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
    pol = policy_from_spec(name, int(budget), num_layers=layers, sets=os.environ.get("PROBE_SET"))
    if os.environ.get("POLICY_SET"):  # hyperparameters: ints where they parse, else strings
        kw = dict(a.split("=") for a in os.environ["POLICY_SET"].split(","))
        kw = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in kw.items()}
        pol = dataclasses.replace(pol, **kw)
    cache = new_cache(cfg, pol, batch=batch, max_len=ctx + 4 * STEPS + 1, dtype=jnp.bfloat16)
    cache, _ = fill_random(pol, cache, ctx, min(ctx, 2048), jax.random.key(0))
    stacked = os.environ.get("STACKED") == "1"
    if stacked:
        cache, params = stack_cache(cache), stack_params(params, cfg)
    tok = jnp.zeros((batch,), jnp.int32)
    step = lambda s: _decode(cfg, pol, STEPS, "pallas", params, *s)
    if os.environ.get("HLO"):
        lowered = _decode.lower(cfg, pol, STEPS, "pallas", params, cache, tok)
        with open(os.environ["HLO"], "w") as f:
            f.write(lowered.compile().as_text())
    state, sec = second_call_seconds(step, (cache, tok))
    print(
        f"{pos[1]} {layers} layers B={batch} {'scan ' if stacked else ''}{knobs}: "
        f"{sec / STEPS * 1e3:.3f} ms/step",
        flush=True,
    )
    log_dir = os.path.join(
        os.environ.get("TRACE", "/tmp/decode_trace"), f"{name}_{len(knobs)}_{int(stacked)}"
    )
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        second_call_seconds(step, state)  # (runs the loop twice: warm-up and timing)
    print(kernel_table(device_kernel_times(find_trace(log_dir)), steps=2 * STEPS), flush=True)


if __name__ == "__main__":
    main()
