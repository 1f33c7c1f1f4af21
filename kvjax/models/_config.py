"""Model configuration: one typed, frozen description of a decoder-only transformer."""

from __future__ import annotations

import dataclasses
import enum


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling for context extension (Hugging Face's `rope_scaling`).

    Attributes:
        kind: "llama3" (Llama 3.1/3.2: long wavelengths divided by `factor`, short ones kept,
            a smooth blend between) or "linear" (every frequency divided by `factor`).
        factor: how much longer the context is than the pretraining one (>= 1).
        low_freq_factor: llama3: wavelengths above original_max_positions / low_freq_factor
            are scaled fully.
        high_freq_factor: llama3: wavelengths below original_max_positions / high_freq_factor
            are kept (> low_freq_factor).
        original_max_positions: llama3: the pretraining context length.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("llama3", "linear"):
            raise ValueError(f"RopeScaling.kind must be 'llama3' or 'linear', got {self.kind!r}")
        if not self.factor >= 1.0:
            raise ValueError(f"RopeScaling.factor must be >= 1, got {self.factor}")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "RopeScaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.original_max_positions < 1:
            raise ValueError(
                f"RopeScaling.original_max_positions must be >= 1, got "
                f"{self.original_max_positions}"
            )


class Arch(enum.StrEnum):
    """Model families kvjax implements."""

    LLAMA = "llama"  # Llama 2/3, Qwen2, Mistral, SmolLM: RoPE, GQA, RMSNorm, SwiGLU
    GPT2 = "gpt2"  # learned absolute positions, LayerNorm, GELU(tanh), MHA


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes and constants of a model. Hashable, so it can be a static jit argument.

    Attributes:
        arch: model family.
        vocab_size: V.
        hidden_size: E, the residual width.
        num_layers: L.
        num_heads: Hq, query heads.
        num_kv_heads: Hkv, key/value heads (GQA group size G = Hq / Hkv).
        head_dim: D.
        intermediate_size: F, MLP width.
        rope_theta: RoPE base (llama family).
        norm_eps: epsilon of RMSNorm / LayerNorm.
        tie_embeddings: the output projection is the transposed token embedding.
        attn_bias: q/k/v projections carry biases (Qwen2).
        max_positions: learned position table size (GPT-2); RoPE models ignore it.
        name: a label for tables.
        rope_scaling: RoPE frequency scaling (Llama 3.1 style); None = plain RoPE.
        sliding_window: W, each query attends to its last W tokens only (Mistral v0.1); None =
            full attention. kvjax runs such a model exactly on sequences of at most W tokens and
            refuses longer ones (ValueError), rather than attending past the window.
    """

    arch: Arch
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attn_bias: bool = False
    max_positions: int = 0
    name: str = ""
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for field in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        ):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig.{field} must be > 0, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelConfig.sliding_window must be >= 1, got {self.sliding_window}")
        if self.arch == Arch.GPT2 and self.max_positions <= 0:
            raise ValueError("ModelConfig.max_positions must be > 0 for GPT-2 (learned positions)")

    @property
    def group_size(self) -> int:
        """G: query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def param_count(self) -> int:
        """Number of weights (tied embeddings counted once)."""
        e, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = e * (q + 2 * kv) + q * e
        if self.arch == Arch.GPT2:
            per_layer = attn + 3 * e + q + e + 2 * e * f + f + e + 4 * e
            extra = self.max_positions * e + 2 * e
        else:
            per_layer = attn + 3 * e * f + 2 * e + (q + 2 * kv if self.attn_bias else 0)
            extra = e
        head = 0 if self.tie_embeddings else e * self.vocab_size
        return self.vocab_size * e + self.num_layers * per_layer + extra + head


# Named presets (random-init shapes for tests and benchmarks; real weights come from files).
SMOLLM2_135M = ModelConfig(
    arch=Arch.LLAMA,
    vocab_size=49152,
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    rope_theta=100000.0,
    norm_eps=1e-5,
    tie_embeddings=True,
    name="SmolLM2-135M",
)
LLAMA3_8B = ModelConfig(
    arch=Arch.LLAMA,
    vocab_size=128256,
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    rope_theta=500000.0,
    norm_eps=1e-5,
    tie_embeddings=False,
    name="Llama-3-8B",
)
TINY_LLAMA = ModelConfig(
    arch=Arch.LLAMA,
    vocab_size=128,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    name="tiny-llama",
)
TINY_GPT2 = ModelConfig(
    arch=Arch.GPT2,
    vocab_size=128,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    head_dim=16,
    intermediate_size=256,
    max_positions=64,
    name="tiny-gpt2",
)
PRESETS = {c.name: c for c in (SMOLLM2_135M, LLAMA3_8B, TINY_LLAMA, TINY_GPT2)}
