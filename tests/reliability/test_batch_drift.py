"""Batches that never drift: each row of a batch of prompts with different lengths generates
exactly what it generates alone (greedy, and sampled with per-row keys); bf16 weights and cache
end to end against float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from policy_cases import NAMES, build

from kvjax.generate import GREEDY, GenerateConfig, Sampling, generate, score_tokens

PROMPTS = [[5, 9, 2, 7, 1], list(range(3, 22)), [11, 4, 8, 30, 2, 6, 9, 1, 3, 60, 7]]
SAMPLED = Sampling(temperature=1.0, top_p=0.9)


def _rows(out):
    toks, n = np.asarray(out.tokens), np.asarray(out.num_generated)
    return [toks[i, : n[i]].tolist() for i in range(len(n))]


# Sampled rows for one policy of each mechanism (positional, ranked, tiered INT8, byte budget
# + low-bit, learned scorer, budgetless low-bit): the keys are per row whatever the policy.
SAMPLED_CASES = {"window", "h2o", "confkv-int8", "qevict", "kvpop", "kivi"}


@pytest.mark.parametrize("case", NAMES)
def test_each_row_generates_what_it_generates_alone(tiny_llama, case):
    config, params = tiny_llama
    policy = build(case, 20)  # prompts of 5, 19, 11 tokens + 10 new: two are compressed
    runs = [(GREEDY, [0, 0, 0])] + [(SAMPLED, [3, 4, 5])] * (case in SAMPLED_CASES)
    for sampling, seeds in runs:
        # One chunk holds every prompt, so a row alone pads to the batch's shape (one compile).
        gen = GenerateConfig(max_new_tokens=10, chunk_size=24, sampling=sampling)
        batch = _rows(generate(config, params, PROMPTS, policy=policy, gen=gen, seed=seeds))
        for i, prompt in enumerate(PROMPTS):
            alone = _rows(
                generate(config, params, [prompt], policy=policy, gen=gen, seed=[seeds[i]])
            )
            assert batch[i] == alone[0], (sampling, i)
    if case in SAMPLED_CASES:  # the sampled rows are samples: another seed, another text
        other = _rows(generate(config, params, PROMPTS[:1], policy=policy, gen=gen, seed=[99]))
        assert other[0] != batch[0]


def test_an_int_seed_gives_row_i_the_key_fold_in_seed_i(tiny_llama):
    config, params = tiny_llama
    gen = GenerateConfig(max_new_tokens=8, chunk_size=8, sampling=SAMPLED)
    policy = build("window", 12)
    batch = _rows(generate(config, params, PROMPTS, policy=policy, gen=gen, seed=7))
    alone = _rows(generate(config, params, PROMPTS[:1], policy=policy, gen=gen, seed=7))
    assert batch[0] == alone[0]
    with pytest.raises(ValueError, match="one per prompt"):
        generate(config, params, PROMPTS, policy=policy, gen=gen, seed=[1, 2])


# bf16 weights and cache against float32, teacher-forced over 48 random tokens. bf16 keeps 8
# significant bits (unit roundoff 2^-9 ≈ 0.2%); the tiny model's logits (|z| ≲ 3) pass through
# ~20 bf16 roundings per layer, so per-token NLL moves by a few hundredths of a nat: we allow
# 0.1 nats per token and 0.02 on the mean, ~3x what we measure (CPU, 2026-12-01), far below
# what a wrong cache (a dropped or misplaced token: > 0.3 nats mean here) gives.
BF16_CASES = ["window", "streaming", "h2o", "confkv-int8", "qevict", "kivi", "kvpop"]


@pytest.mark.parametrize("case", BF16_CASES)
def test_bf16_end_to_end_is_float32_within_tolerance(tiny_llama, case):
    config, params = tiny_llama
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    policy = build(case, 16)
    ids = np.random.default_rng(5).integers(0, 128, size=(1, 48))
    f32 = np.asarray(score_tokens(config, params, ids, policy=policy, segment=16).nll)
    b16 = score_tokens(config, p16, ids, policy=policy, segment=16, cache_dtype=jnp.bfloat16)
    assert b16.cache.layers[0].k.dtype == jnp.bfloat16
    b16 = np.asarray(b16.nll)
    # QEvict routes whole windows by a ranking of attention mass: bf16 noise can flip a near
    # tie between two windows (a different tier for 16 tokens), which moves single tokens by
    # ~0.13 nats here (CPU, 2026-12-01) while the mean stays within 0.01.
    assert np.max(np.abs(b16 - f32)) < (0.2 if case == "qevict" else 0.1)
    assert abs(b16.mean() - f32.mean()) < 0.02
    # generate end to end with GenerateConfig.cache_dtype: runs, valid ids, a bf16 cache.
    gen = GenerateConfig(max_new_tokens=6, chunk_size=8, cache_dtype="bfloat16")
    out = generate(config, p16, PROMPTS, policy=policy, gen=gen)
    assert np.asarray(out.telemetry.slot_bytes)[0, 0] == 2 * config.head_dim * 2
    toks = np.asarray(out.tokens)
    assert toks.min() >= 0 and toks.max() < config.vocab_size
