"""The one shared list of policies every generic test runs over: (name, mild kwargs, aggressive
kwargs). Budgets are given separately so tests can scale them."""

import pathlib

from kvjax.policies import make_policy

# Random-init KVpop scorers shaped for TINY_LLAMA (the shipped ones fit SmolLM2 only).
_TINY_SCORERS = pathlib.Path(__file__).parent / "train" / "data"

# name -> extra kwargs (small windows so tiny tests exercise eviction)
CASES = {
    "full": {},
    "window": {},
    "streaming": {"sinks": 2},
    "h2o": {},
    "tova": {},
    "random": {"recent": 3, "seed": 1},
    "snapkv": {"window": 3, "observation": 4, "pool": 3},
    "confkv": {"protected": 3, "fp_window": 3, "int8": False},
    "confkv-int8": {"protected": 2, "fp_window": 4},
    "confkv-l": {"protected": 2, "fp_window": 3, "num_layers": 2},
    "kivi": {"residual": 8, "group": 4, "bits": 2, "value_group": 8},
    "qevict": {"window": 4, "sinks": 2, "band": 4},
    "kvpop": {"sinks": 2, "window": 3, "scorer": str(_TINY_SCORERS / "tiny_llama_mlstm.msgpack")},
    "kvpop-mlp": {"sinks": 2, "window": 3, "scorer": str(_TINY_SCORERS / "tiny_llama_mlp.msgpack")},
    "knorm": {"window": 2},
    "keydiff": {"window": 2},
    "pyramidkv": {"window": 3, "observation": 4, "pool": 3, "beta": 2, "num_layers": 2},
    "chunkkv": {"window": 3, "observation": 4, "pool": 3, "chunk": 3},
    "kvzip": {"n_sink": 2, "window": 2},
    "expected": {"n_sink": 2, "window": 2},
}
NAMES = list(CASES)


def build(case: str, budget: int):
    """The policy of a case at a budget (full ignores the budget)."""
    name = {"confkv-int8": "confkv"}.get(case, case)
    if name in ("full", "kivi"):
        return make_policy(name, **CASES[case])
    return make_policy(name, budget, **CASES[case])
