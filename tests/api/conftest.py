"""A tiny random Llama with a byte-level tokenizer, wrapped as a `kvjax.LM` (fast API tests)."""

import dataclasses

import jax
import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

import kvjax
from kvjax.models import TINY_LLAMA, init_params
from kvjax.weights import Tokenizer

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def byte_tokenizer() -> Tokenizer:
    """One id per byte (256) plus `<eos>` = 256."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = tokenizers.Tokenizer(
        models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[])
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<eos>", special=True, normalized=False)])
    return Tokenizer(backend, bos_id=None, eos_ids=[256], chat_template=TEMPLATE)


@pytest.fixture(scope="session")
def tiny_lm() -> kvjax.LM:
    config = dataclasses.replace(TINY_LLAMA, vocab_size=257)
    params = init_params(config, jax.random.key(1))
    return kvjax.LM(config=config, params=params, tokenizer=byte_tokenizer(), source="tiny")
