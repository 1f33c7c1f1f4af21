"""Tokenizer from the embedded GGUF against transformers' goldens, chat templates, HF dirs."""

from __future__ import annotations

import hashlib
import json

import gguf
import jinja2
import numpy as np
import pytest

from kvjax.weights import Tokenizer, essay_text


@pytest.fixture(scope="module")
def tokenizer(smollm) -> Tokenizer:
    return smollm.tokenizer


@pytest.fixture(scope="module")
def golden_tokens(goldens) -> dict:
    return json.loads((goldens / "smollm2_tokenizer.json").read_text())


@pytest.fixture(scope="module")
def golden_chat(goldens) -> dict:
    return json.loads((goldens / "smollm2_chat_greedy.json").read_text())


@pytest.mark.slow
def test_hello_world_and_specials(tokenizer):
    ids = tokenizer.encode("Hello world")
    assert ids == [19556, 905] and tokenizer.decode(ids) == "Hello world"
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_start|>user") == [1, 4093]
    assert tokenizer.decode([1, 4093, 2], skip_special=True) == "user"
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_ids) == (49152, 1, (2,))
    assert tokenizer.token_id("<|im_end|>") == 2
    assert repr(tokenizer) == (
        "Tokenizer(vocab_size=49152, bos_id=1, eos_ids=(2,), chat_template=True)"
    )
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tokenizer.token_id("<|nope|>")


@pytest.mark.slow
def test_ids_match_transformers(tokenizer, golden_tokens):
    assert len(golden_tokens["cases"]) >= 10
    for case in golden_tokens["cases"]:
        assert tokenizer.encode(case["text"]) == case["ids"], case["text"]
        assert tokenizer.decode(case["ids"]) == case["decoded"], case["text"]
    for token, token_id in golden_tokens["special_tokens"].items():
        assert tokenizer.encode(token) == [token_id]
    assert tokenizer.bos_id == golden_tokens["bos_id"]
    assert tokenizer.eos_ids == (golden_tokens["eos_id"],)
    assert tokenizer.vocab_size == golden_tokens["vocab_size"]


@pytest.mark.slow
def test_essay_ids_match_transformers(tokenizer, goldens):
    ppl = json.loads((goldens / "smollm2_ppl.json").read_text())
    ids = tokenizer.encode(essay_text(ppl["text_file"]))[: ppl["n_tokens"]]
    assert ids[:32] == ppl["first_ids"]
    digest = hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()
    assert digest == ppl["ids_sha256"]
    logits = np.load(goldens / "smollm2_logits.npz")
    assert ids[: len(logits["input_ids"])] == logits["input_ids"].tolist()


@pytest.mark.slow
def test_chat_prompt_matches_transformers(tokenizer, golden_chat):
    assert tokenizer.chat_template == golden_chat["chat_template"]
    for case in golden_chat["cases"]:
        prompt = tokenizer.apply_chat_template(case["messages"])
        assert prompt == case["prompt_text"]
        assert tokenizer.encode(prompt) == case["input_ids"]
    without = tokenizer.apply_chat_template(
        golden_chat["cases"][0]["messages"], add_generation_prompt=False
    )
    assert without + "<|im_start|>assistant\n" == golden_chat["cases"][0]["prompt_text"]


TEMPLATE = (
    "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    "{{ bos_token }}{% for m in messages %}\n"
    "    {% if m['content'] %}{{ m['role'] }}: {{ m['content'] | tojson }}{% endif %}\n"
    "{% endfor %}{{ eos_token }}"
)


@pytest.mark.slow
def test_hf_dir_round_trip(tokenizer, tmp_path):
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "chat_template": TEMPLATE,
        "eos_token": {"content": "<|im_end|>"},
        "bos_token": "<|im_start|>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    text = "<|im_start|>user\nnumbers 12345 and émoji 🙂<|im_end|>"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert (loaded.bos_id, loaded.eos_ids) == (1, (2, 0))
    # Checked against transformers' render_jinja_template: trim_blocks drops the newline after
    # each block tag, lstrip_blocks the indent before one; tojson escapes neither HTML nor é.
    messages = [{"role": "user", "content": "<b>"}, {"role": "x", "content": "é"}]
    prompt = loaded.apply_chat_template(messages)
    assert prompt == '<|im_start|>user: "<b>"x: "é"<|im_end|>'
    with pytest.raises(jinja2.TemplateError, match="user first"):
        loaded.apply_chat_template([{"role": "assistant", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template([{}, {}]) == "2"


def test_hf_dir_without_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_bad_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def write_vocab_gguf(path, model: str, pre: str = "smollm") -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab", "<ctl>", "1", "2", "12"])
    writer.add_token_merges(["a b", "1 2"])
    writer.add_token_types([1, 1, 1, 3, 1, 1, 1])
    writer.add_eos_token_id(3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gguf_tokenizer(tmp_path):
    write_vocab_gguf(tmp_path / "t.gguf", "gpt2")
    tok = Tokenizer.from_gguf(tmp_path / "t.gguf")
    assert tok.encode("abab<ctl>b") == [2, 2, 3, 1]
    assert tok.encode("12") == [4, 5]  # 'smollm' splits digits apart before BPE, like llama.cpp
    write_vocab_gguf(tmp_path / "g.gguf", "gpt2", pre="gpt2")
    assert Tokenizer.from_gguf(tmp_path / "g.gguf").encode("12") == [6]
    assert (tok.bos_id, tok.eos_ids, tok.chat_template) == (None, (3,), None)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unsupported_tokenizer_model(tmp_path):
    write_vocab_gguf(tmp_path / "t.gguf", "llama")
    with pytest.raises(ValueError, match="tokenizer model 'llama'; only 'gpt2'"):
        Tokenizer.from_gguf(tmp_path / "t.gguf")


def test_unsupported_pre_tokenizer(tmp_path):
    write_vocab_gguf(tmp_path / "t.gguf", "gpt2", pre="qwen2")
    with pytest.raises(ValueError, match="pre-tokenizer 'qwen2'; supported"):
        Tokenizer.from_gguf(tmp_path / "t.gguf")
