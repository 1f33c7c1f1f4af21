"""Tokenizer: a thin wrapper over a `tokenizers.Tokenizer`, built from a GGUF or an HF directory,
with chat templates rendered the way transformers renders them."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

import gguf
import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from kvjax.weights._gguf import gguf_field, open_gguf
from kvjax.weights._hf_config import read_json

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)
# `tokenizer.ggml.pre` values whose llama.cpp split is GPT-2's regex, alone or after splitting
# every digit apart (as SmolLM2's own tokenizer.json does with a `Digits` pre-tokenizer).
_GPT2_SPLIT = frozenset({"gpt2"})
_DIGITS_THEN_GPT2_SPLIT = frozenset({"smollm", "starcoder", "refact", "codeshell"})


def _byte_alphabet() -> frozenset[str]:
    """The 256 characters GPT-2's byte-level BPE spells bytes with."""
    return frozenset(pre_tokenizers.ByteLevel.alphabet())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Like transformers: no HTML escaping, unlike jinja's built-in filter.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids, plus the model's chat template.

    Build with `Tokenizer.from_gguf(...)` or `Tokenizer.from_hf_dir(...)`.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self._bos_id = bos_id
        self._eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self._chat_template = chat_template
        self._compiled: jinja2.Template | None = None

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self._bos_id}, "
            f"eos_ids={self._eos_ids}, chat_template={self._chat_template is not None})"
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence id, if the model has one."""
        return self._bos_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Ids that end generation (e.g. `<|im_end|>`), deduplicated, in order of declaration."""
        return self._eos_ids

    @property
    def chat_template(self) -> str | None:
        """Jinja2 chat template source, or None."""
        return self._chat_template

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS/EOS is added, special tokens written in the text match."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids` (any iterable of ints, e.g. a 1-D int32 array)."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_id(self, token: str) -> int:
        """Id of one vocabulary entry, e.g. `"<|im_end|>"`.

        Raises:
            ValueError: not in the vocabulary.
        """
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"Token {token!r} is not in the vocabulary")
        return token_id

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """Render a conversation with the model's template, as transformers does.

        Args:
            messages: `[{"role": "user", "content": "..."}, ...]`.
            add_generation_prompt: end with the header of an assistant turn.

        Returns:
            The prompt text (tokenize it with `encode`).

        Raises:
            ValueError: the tokenizer has no chat template.
            jinja2.TemplateError: the template rejected the messages (`raise_exception`).
        """
        if self._chat_template is None:
            raise ValueError("This tokenizer has no chat template; format the prompt yourself")
        if self._compiled is None:
            self._compiled = _compile_template(self._chat_template)
        eos = self._eos_ids[0] if self._eos_ids else None
        return self._compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token(self._bos_id) or "",
            eos_token=self._token(eos) or "",
        )

    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike | gguf.GGUFReader) -> Tokenizer:
        """Byte-level BPE from a GGUF file's `tokenizer.ggml.*` keys.

        Control tokens (token type 3, e.g. `<|im_start|>`) become special added tokens, so they
        encode to one id; user-defined tokens (type 4) become plain added tokens.

        Raises:
            FileNotFoundError / ValueError: as `open_gguf`; ValueError when the tokenizer model
                is not 'gpt2' (byte-level BPE), the pre-tokenizer is not one of GPT-2's regex
                family, or the vocabulary keys are missing.
        """
        reader = (
            path_or_reader
            if isinstance(path_or_reader, gguf.GGUFReader)
            else open_gguf(path_or_reader)
        )
        kind = gguf_field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF file {reader.data.filename} has tokenizer model {kind!r}; only 'gpt2' "
                "(byte-level BPE) is supported"
            )
        pre = gguf_field(reader, "tokenizer.ggml.pre", "gpt2")
        if pre not in _GPT2_SPLIT | _DIGITS_THEN_GPT2_SPLIT:
            raise ValueError(
                f"GGUF file {reader.data.filename} has pre-tokenizer {pre!r}; supported: "
                f"{sorted(_GPT2_SPLIT | _DIGITS_THEN_GPT2_SPLIT)}"
            )
        try:
            backend = _gguf_backend(reader, pre)
        except ValueError as e:
            if str(reader.data.filename) in str(e):
                raise
            raise ValueError(f"GGUF file {reader.data.filename}: corrupt tokenizer ({e})") from None
        except Exception as e:  # tokenizers raises bare Exceptions on a bad vocab or merges
            raise ValueError(
                f"GGUF file {reader.data.filename}: corrupt tokenizer ({type(e).__name__}: {e})"
            ) from None
        eos = [
            gguf_field(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")
        ]
        return cls(
            backend,
            bos_id=gguf_field(reader, "tokenizer.ggml.bos_token_id", None),
            eos_ids=[i for i in eos if i is not None],
            chat_template=gguf_field(reader, "tokenizer.chat_template", None),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """From `tokenizer.json`, with template and special tokens from `tokenizer_config.json`,
        `chat_template.jinja`, `generation_config.json` and `config.json` when present.

        Raises:
            FileNotFoundError: no tokenizer.json.
            ValueError: a file that is not valid JSON / not a valid tokenizer.
        """
        directory = pathlib.Path(path)
        file = directory / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer.json not found: {file}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"{file} is not a valid tokenizer.json: {e}") from e

        def optional(name: str) -> dict[str, Any]:
            return read_json(directory / name) if (directory / name).is_file() else {}

        tok_cfg, gen_cfg, model_cfg = (
            optional("tokenizer_config.json"),
            optional("generation_config.json"),
            optional("config.json"),
        )
        try:
            ids = [backend.token_to_id(_token_text(tok_cfg.get("eos_token")) or "")]
            for cfg in (gen_cfg, model_cfg):
                value = cfg.get("eos_token_id")
                ids += value if isinstance(value, list) else [value]
            bos = backend.token_to_id(_token_text(tok_cfg.get("bos_token")) or "")
            if bos is None:
                bos = gen_cfg.get("bos_token_id", model_cfg.get("bos_token_id"))
            template = _template_text(tok_cfg.get("chat_template"))
            if template is not None and not isinstance(template, str):
                raise TypeError(f"chat_template is a {type(template).__name__}, not text")
        except (TypeError, AttributeError, ValueError) as e:  # values of the wrong type
            raise ValueError(
                f"{directory}: a tokenizer/generation config value is invalid ({e})"
            ) from None
        if (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(
            backend,
            bos_id=bos,
            eos_ids=[i for i in ids if isinstance(i, int)],
            chat_template=template,
        )


def _token_text(token: str | dict[str, Any] | None) -> str | None:
    """`"<|im_end|>"` or `{"content": "<|im_end|>", ...}` (an AddedToken dump) -> the text."""
    return token.get("content") if isinstance(token, dict) else token


def _template_text(template: str | list[dict[str, str]] | None) -> str | None:
    """A template string, or the `default` of a list of named templates."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


def _gguf_backend(reader, pre: str) -> tokenizers.Tokenizer:
    """The BPE backend of a GGUF file's gpt2-style tokenizer (vocab, merges, specials)."""
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges")]
    types = gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    backend = tokenizers.Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_SPLIT:
        digits = pre_tokenizers.Digits(individual_digits=True)
        backend.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    alphabet = _byte_alphabet()
    # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel (as in
    # transformers' GGUF loader): adding it would change how ordinary text splits.
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, token_type in zip(tokens, types, strict=True)
            if token_type == _CONTROL and set(t) <= alphabet
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, token_type in zip(tokens, types, strict=True)
            if token_type == _USER_DEFINED
        ]
    )
    return backend
