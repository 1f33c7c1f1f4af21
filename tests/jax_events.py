"""Count JAX's monitoring events while a function runs (compiles, lowerings)."""

from __future__ import annotations

from collections.abc import Callable

import jax.monitoring

COMPILE = "/jax/core/compile/backend_compile_duration"  # an XLA compilation
LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # a program traced and lowered


def count_events(event: str, fn: Callable[[], object]) -> int:
    """How many times `event` fires while fn() runs."""
    n = [0]

    def listen(name, duration, **kw):
        n[0] += name == event

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return n[0]
