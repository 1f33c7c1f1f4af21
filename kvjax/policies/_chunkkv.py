"""ChunkKV (Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
Long-Context LLM Inference"): tokens are kept or dropped in chunks of consecutive positions, so
the kept context stays made of whole phrases. A chunk's score is the mean of its tokens' SnapKV
scores (pooled observation-window votes). kvpress: `ChunkKVPress(press=SnapKVPress(),
chunk_length=20)`; its SnapKV defaults are window_size=64, kernel_size=5.

Differences from kvpress, both from kvjax keeping decisions per KV head: kvpress sums the scores
over heads so that every head keeps the same chunks (here each KV head picks its own), and it
keeps whole chunks only (int(chunks × (1 − ratio)) of them), where the budget here is exact: the
chunk at the boundary keeps its best-scored tokens.

Chunks are scored only when a prompt chunk of several tokens is merged; decode (one token per
call) is frozen as in SnapKV. On a stream of one-token calls and no prefill (teacher-forced
perplexity, `kvjax compare`) nothing is ever scored: the first `budget − 1 − window` tokens and
the window stay, exactly as in `pyramidkv` with the same window and its pyramid off
(docs/policies.md, "Prefill-time presses on one-token streams").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.policies._regions import Tokens
from kvjax.policies._snapkv import SnapKVPolicy


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkKVPolicy(SnapKVPolicy):
    """SnapKV scores averaged over chunks of `chunk` consecutive positions; chunks kept whole.

    Priority order: the chunk's mean pooled vote, then the token's own pooled vote, then the
    earlier position.

    Attributes:
        budget: tokens kept per KV head per layer (window included).
        window, observation, pool: SnapKV's (kvpress: window_size=64 both, kernel_size=5).
        chunk: positions per chunk (kvpress: chunk_length=20); chunk c holds positions
            [c·chunk, (c + 1)·chunk).
    """

    name = "chunkkv"
    window: int = 64
    observation: int = 64
    pool: int = 5
    chunk: int = 20

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"ChunkKVPolicy.chunk must be >= 1, got {self.chunk}")
        super().__post_init__()

    def candidate_scores(self, cands: Tokens) -> jax.Array:
        """[B, H, N] priorities: minus each candidate's rank by (chunk mean, own pooled vote)."""
        pooled = super().candidate_scores(cands)
        b, h, n = pooled.shape
        # Work in position order (empty candidates last): a chunk is a run of equal pos // chunk.
        by_pos = jnp.argsort(jnp.where(cands.pos >= 0, cands.pos, jnp.iinfo(jnp.int32).max), -1)
        pos = jnp.take_along_axis(cands.pos, by_pos, -1)
        held = pos >= 0
        vote = jnp.where(held, jnp.take_along_axis(pooled, by_pos, -1), -jnp.inf)
        cid = jnp.where(held, pos // self.chunk, -1)
        starts = jnp.concatenate([jnp.ones((b, h, 1), bool), cid[..., 1:] != cid[..., :-1]], -1)
        dense = jnp.cumsum(starts, axis=-1, dtype=jnp.int32) - 1  # chunk index in its row
        seg = (jnp.arange(b * h, dtype=jnp.int32).reshape(b, h, 1) * n + dense).reshape(-1)
        total = lambda x: jax.ops.segment_sum(x.reshape(-1), seg, num_segments=b * h * n)
        sums, counts = total(jnp.where(held, vote, 0.0)), total(held.astype(jnp.float32))
        mean = jnp.where(held, (sums / jnp.maximum(counts, 1.0))[seg].reshape(b, h, n), -jnp.inf)
        # Lexicographic order by stable sorts, the minor key first: position (already; ties go
        # to the earlier token), own pooled vote, chunk mean.
        order = jnp.broadcast_to(jnp.arange(n), (b, h, n))
        for key in (vote, mean):
            step = jnp.argsort(-jnp.take_along_axis(key, order, -1), axis=-1, stable=True)
            order = jnp.take_along_axis(order, step, -1)
        rank = jnp.argsort(jnp.take_along_axis(by_pos, order, -1), axis=-1)  # candidate -> rank
        return jnp.where(cands.pos >= 0, -rank.astype(jnp.float32), -jnp.inf)
