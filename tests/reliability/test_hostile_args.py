"""Hostile arguments at the API and the CLI: one clear ValueError (CLI: exit 2, one line), never
a crash deep in XLA; budgets at every boundary; NaN/Inf reaching a policy's scores."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from policy_cases import build

from kvjax.attention import AttnStats
from kvjax.cli import main
from kvjax.generate import GenerateConfig, generate, new_cache, score_tokens
from kvjax.models import TINY_GPT2
from kvjax.policies import make_policy

GEN = GenerateConfig(max_new_tokens=4, chunk_size=8)


@pytest.mark.parametrize(
    "prompts,match",
    [
        ([], "prompt"),
        ([[]], "empty"),
        ([[1, 2], []], "empty"),
        ([[1, -1]], "out of range|range"),
        ([[1, 128]], "out of range|range"),
    ],
)
def test_generate_rejects_bad_prompts(tiny_llama, prompts, match):
    config, params = tiny_llama
    with pytest.raises(ValueError, match=match):
        generate(config, params, prompts, policy=build("window", 8), gen=GEN)


def test_prompts_longer_than_max_positions(tiny_gpt2):
    config, params = tiny_gpt2
    n = TINY_GPT2.max_positions
    with pytest.raises(ValueError, match="learned positions"):
        generate(config, params, [[1] * n], policy=build("window", 8), gen=GEN)
    with pytest.raises(ValueError, match="learned positions"):
        score_tokens(config, params, np.ones(n + 1, np.int32), policy=build("full", 0))
    with pytest.raises(ValueError, match="S >= 2"):
        score_tokens(config, params, np.ones(1, np.int32), policy=build("full", 0))


# The smallest budget of each case, derived by hand from the definition (N attended = the
# current token + what the cache keeps): window 1; streaming sinks + 1; ranked policies
# 1 + ring + ranked >= 1 (+ CONF-KV's tight budget round(N/2) (x pyramid) >= 1 + ring + 1, with
# Python's half-to-even rounding); KVpop 1 + sinks + window + 1; QEvict one low-bit page after
# the current token, sinks and ring (band 4 + window 4).
SMALLEST = {
    "window": 1,
    "streaming": 3,
    "h2o": 3,
    "tova": 3,
    "random": 5,
    "snapkv": 5,
    "confkv": 10,
    "confkv-int8": 11,
    "confkv-l": 19,
    "qevict": 12,  # current + sinks 2 + band 4 + window 4, then one low-bit page (bf16 stats)
    "kvpop": 7,
    "kvpop-mlp": 7,
}


def _steps(config, params, policy, n=12):
    """n decode steps of random tokens; per step the tokens attended (cached + 1), max over
    layers and heads."""
    from kvjax.generate import model_step

    cache = new_cache(config, policy, batch=1, max_len=n, dtype=jnp.float32)
    step = jax.jit(lambda c, t: model_step(config, policy, params, c, t, jnp.ones((1, 1), bool)))
    most = 0
    for t in range(n):
        counts = [
            int(
                jnp.max(
                    jnp.sum(ly.pos >= 0, -1)
                    + (0 if ly.int8 is None else jnp.sum(ly.int8.pos >= 0, -1))
                )
            )
            for ly in cache.layers
        ]
        most = max(most, max(counts) + 1)
        _, cache = step(cache, jnp.full((1, 1), t % 128, jnp.int32))
    return most


@pytest.mark.parametrize("case", sorted(SMALLEST))
def test_budgets_at_the_boundary(tiny_llama, case):
    config, params = tiny_llama
    n = SMALLEST[case]
    with pytest.raises(ValueError, match="budget|window|ranked"):
        new_cache(config, build(case, n - 1), batch=1, max_len=8, dtype=jnp.float32)
    policy = build(case, n)
    if case != "qevict":  # QEvict's budget is bytes: its low-bit tokens cost less than one
        # CONF-KV-L's budget is the middle of its pyramid: the shallowest layer attends most.
        most = max(policy.max_budget(li) for li in range(2)) if case == "confkv-l" else n
        assert _steps(config, params, policy, most + 4) == most


@pytest.mark.parametrize("budget", [2.5, "8", True, None])
def test_budget_must_be_an_int(budget):
    with pytest.raises(ValueError, match="budget"):
        make_policy("window", budget)


@pytest.mark.parametrize("case", ["h2o", "tova", "confkv", "confkv-int8", "snapkv", "qevict"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_inf_attention_mass_keeps_the_cache_valid(tiny_llama, case, bad):
    """NaN/Inf masses reaching the scores: positions stay unique, the newest token stays, and
    the cache never holds more than its budget."""
    config, _ = tiny_llama
    budget = 16
    policy = build(case, budget)
    cache = new_cache(config, policy, batch=1, max_len=64, dtype=jnp.float32)
    layer = cache.layers[0]
    h, d = layer.k.shape[1], layer.k.shape[3]

    @jax.jit
    def step(layer, t, masses):
        tier = lambda x, m: None if x is None else m[: x.pos.size].reshape(x.pos.shape)
        st = AttnStats(
            slot_mass=masses[: layer.pos.size].reshape(layer.pos.shape),
            new_mass=masses[:h].reshape(1, h, 1),
            lse=jnp.zeros((1, 1, config.num_heads)),
            int8_mass=tier(layer.int8, masses), lowbit_mass=tier(layer.lowbit, masses),
        )  # fmt: skip
        kv = jnp.full((1, 1, h, d), 1.0) * t.astype(jnp.float32)
        pos = jnp.full((1, 1), t, jnp.int32)
        return policy.write(
            layer, kv, -kv, pos, jnp.ones((1, 1), bool), st, cache.policy_state, layer_index=0
        )

    rng = np.random.default_rng(0)
    for t in range(48):
        m = rng.random(4096).astype(np.float32)
        m[rng.random(4096) < 0.3] = bad
        layer = step(layer, jnp.int32(t), jnp.asarray(m))
        tiers = [layer.pos] + [
            x.pos.reshape(1, h, -1) for x in (layer.int8, layer.lowbit) if x is not None
        ]
        pos = np.concatenate([np.asarray(p) for p in tiers], axis=-1)[0]
        for hh in range(h):
            kept = pos[hh][pos[hh] >= 0]
            assert len(kept) == len(set(kept.tolist())), f"duplicate position at step {t}"
            assert t in kept, f"the newest token was dropped at step {t}"
            if case != "qevict":
                assert len(kept) <= budget - 1


@pytest.mark.parametrize(
    "argv",
    [
        ["ppl", "--policy", "full", "--budget", "5"],
        ["ppl", "--policy", "kivi", "--budget", "5"],
        ["ppl", "--policy", "window", "--budget", "0"],
        ["ppl", "--policy", "window"],
        ["ppl", "--policy", "streaming", "--budget", "4"],
        ["ppl", "--policy", "h2o", "--budget", "2"],
        ["generate", "--policy", "full", "--budget", "5", "--prompt", "hi"],
    ],
)
def test_cli_bad_arguments_exit_2_with_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
