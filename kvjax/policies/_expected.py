"""ExpectedAttention (Devoto et al., 2025, "Expected Attention: KV Cache Compression by
Estimating Attention from Future Queries Distribution"): model the next queries as Gaussian
with the mean μ and covariance Σ of the context's queries (before RoPE, sinks left out), rotated
by the RoPE rotation averaged over the next n positions R̄; a key k is expected to receive
softmax_k(R̄μ·k/√D + kᵀR̄ΣR̄ᵀk/(2D)), averaged over the KV head's query group and scaled by
‖v‖. kvpress: `ExpectedAttentionPress` (n_future_positions=512, n_sink=4, use_covariance,
use_vnorm, epsilon=0; sinks get the largest score).

The query statistics come from the model's queries, which policies never see:
`expected_attention_scores` is the rule over arrays and `kvjax.eval.press_context` feeds it the
context's queries (from the public `forward`) and writes the scores into the cache. In the
generate loop on its own the policy keeps what the press left (SnapKV-like frozen decode).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.policies._pressscored import PressScoredPolicy

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpectedAttentionPolicy(PressScoredPolicy):
    """Keep the keys future queries are expected to attend to (scores from the press).

    Attributes:
        budget: tokens attended per step per KV head per layer (sinks and window included).
        n_future_positions: positions the RoPE rotation is averaged over (kvpress: 512).
        n_sink: first tokens never evicted and left out of the statistics (kvpress: 4).
        use_covariance: add the covariance term (kvpress: True).
        use_vnorm: scale by the value norm (kvpress: True).
        epsilon: added to the expected attention before the value scaling (kvpress: 0).
        window: newest tokens never evicted (the engine needs >= 1).
    """

    name = "expected"
    n_future_positions: int = 512
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        if self.n_future_positions < 1:
            raise ValueError(
                "ExpectedAttentionPolicy: n_future_positions must be >= 1, got "
                f"{self.n_future_positions}"
            )
        super().__post_init__()

    def scores(self, q: Array, k: Array, v: Array, length: int, rope_theta: float) -> Array:
        """`expected_attention_scores` with this policy's settings."""
        return expected_attention_scores(
            q, k, v, length=length, rope_theta=rope_theta,
            n_future=self.n_future_positions, n_sink=self.n_sink,
            use_covariance=self.use_covariance, use_vnorm=self.use_vnorm, epsilon=self.epsilon,
        )  # fmt: skip


def mean_rotation(d: int, start: int, n: int, theta: float) -> Array:
    """[D, D] float32: the RoPE rotation (half-split layout) averaged over positions
    [start, start + n)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
    ang = jnp.arange(start, start + n, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    c, s = jnp.mean(jnp.cos(ang), axis=0), jnp.mean(jnp.sin(ang), axis=0)  # [D/2]
    # x' = [x1 c − x2 s, x2 c + x1 s]: R̄ = [[diag c, −diag s], [diag s, diag c]]
    cd, sd = jnp.diag(c), jnp.diag(s)
    return jnp.block([[cd, -sd], [sd, cd]])


def unrotate(x: Array, positions: Array, theta: float) -> Array:
    """Undo RoPE (half-split layout): x [B, T, H, D] rotated at positions [B, T] → float32."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # [B, T, D/2]
    c, s = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    return jnp.concatenate([x1 * c + x2 * s, x2 * c - x1 * s], axis=-1)


def expected_attention_scores(
    q: Array,
    k: Array,
    v: Array,
    *,
    length: int,
    rope_theta: float,
    n_future: int = 512,
    n_sink: int = 4,
    use_covariance: bool = True,
    use_vnorm: bool = True,
    epsilon: float = 0.0,
) -> Array:
    """ExpectedAttention's scores of a context's keys.

    Args:
        q: [B, S, Hq, D] the context's queries before RoPE.
        k: [B, Hkv, S, D] its keys after RoPE; v: [B, Hkv, S, D] its values.
        length: S, the context length (the future starts there).
        rope_theta: the model's RoPE base.

    Returns:
        [B, Hkv, S] float32 scores; the first n_sink tokens get the largest score.
    """
    b, s, hq, d = q.shape
    hkv = k.shape[1]
    if s <= n_sink:
        raise ValueError(f"expected_attention_scores: the context ({s}) must exceed n_sink")
    qf = q[:, n_sink:].astype(jnp.float32)
    kf, vf = k[:, :, n_sink:].astype(jnp.float32), v[:, :, n_sink:].astype(jnp.float32)
    mu = jnp.mean(qf, axis=1)  # [B, Hq, D]
    rot = mean_rotation(d, length, n_future, rope_theta)
    mu_r = jnp.einsum("ij,bhj->bhi", rot, mu)
    kg = jnp.repeat(kf, hq // hkv, axis=1)  # [B, Hq, S', D]
    logits = jnp.einsum("bhd,bhnd->bhn", mu_r, kg) / jnp.sqrt(jnp.float32(d))
    if use_covariance:
        centred = qf - mu[:, None]
        cov = jnp.einsum("bshi,bshj->bhij", centred, centred) / qf.shape[1]
        cov_r = jnp.einsum("ik,bhkl,jl->bhij", rot, cov, rot)
        logits = logits + jnp.einsum("bhni,bhij,bhnj->bhn", kg, cov_r, kg) / d / 2
    probs = jax.nn.softmax(logits, axis=-1).reshape(b, hkv, hq // hkv, -1).mean(axis=2)
    if use_vnorm:
        probs = (probs + epsilon) * jnp.sqrt(jnp.sum(jnp.square(vf), axis=-1))
    top = jnp.max(probs)
    return jnp.concatenate([jnp.full((b, hkv, n_sink), top), probs], axis=-1)
