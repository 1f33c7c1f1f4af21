"""What the convenience API returns: text and tokens with the core's telemetry, perplexities."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.generate import Telemetry
from kvjax.policies import Policy


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationResult:
    """What `LM.generate` / `LM.chat` return. List fields for a list input, else one value.

    Attributes:
        text: the generated text, without stop tokens.
        tokens: the generated ids, without the stop token.
        finish_reason: "stop" (a stop token ended it) or "length" (max_new_tokens reached).
        prompt_tokens: tokens in the (templated) prompt.
        telemetry: the core's per-step `Telemetry` ([N, B] arrays, B = number of prompts), e.g.
            `telemetry.live_bytes()` for the live K/V bytes after every step.
        policy: the policy that ran (with its budget and layer count resolved).
    """

    text: str | list[str]
    tokens: list[int] | list[list[int]]
    finish_reason: str | list[str]
    prompt_tokens: int | list[int]
    telemetry: Telemetry
    policy: Policy


@dataclasses.dataclass(frozen=True, kw_only=True)
class PerplexityResult:
    """What `LM.ppl` returns. List fields for a list input, else one value.

    Attributes:
        ppl: exp(mean NLL) of each text's tokens after the first.
        nll: [S_i - 1] float32 per-token negative log-likelihoods of each text.
        num_tokens: tokens in each text.
        policy: the policy that ran.
    """

    ppl: float | list[float]
    nll: np.ndarray | list[np.ndarray]
    num_tokens: int | list[int]
    policy: Policy
