"""Host-side input checks: bad input fails here with a clear message, never deep in XLA."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def check_lengths(prompts: Sequence[Sequence[int]]) -> np.ndarray:
    """[B] int32 prompt lengths; raises if the batch or any prompt is empty."""
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths == 0).any():
        raise ValueError(f"prompt {int(np.argmin(lengths))} is empty: every prompt needs a token")
    return lengths


def pad_prompts(prompts: Sequence[Sequence[int]], multiple: int, pad_id: int) -> np.ndarray:
    """Right-pad prompts to one length, a multiple of `multiple`. Returns [B, S] int64."""
    longest = max(len(p) for p in prompts)
    s = -(-longest // multiple) * multiple
    out = np.full((len(prompts), s), pad_id, np.int64)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = np.asarray(p, np.int64).reshape(-1)
    return out


def check_tokens(tokens: np.ndarray, lengths: np.ndarray, vocab_size: int) -> None:
    """Raise ValueError naming the first real token id outside [0, vocab_size)."""
    real = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
    bad = real & ((tokens < 0) | (tokens >= vocab_size))
    if bad.any():
        b, t = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"token id {int(tokens[b, t])} at prompt {b}, position {t} is out of "
            f"range [0, {vocab_size})"
        )


def check_window(config, total: int) -> None:
    """Raise ValueError when `total` tokens exceed the model's sliding attention window: kvjax
    attends to every cached token, which equals windowed attention only within the window."""
    w = config.sliding_window
    if w is not None and total > w:
        raise ValueError(
            f"{total} tokens exceed the model's sliding attention window of {w} tokens; kvjax "
            f"runs sliding-window models exactly only up to it (shorten the input to <= {w})"
        )
