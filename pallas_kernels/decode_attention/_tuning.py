"""Tuned launch parameters, as data keyed by `jax.Device.device_kind`.

Numbers for a device come from `kvjax bench kernel` sweeps on that device (docs/benchmarks.md);
a device that is not listed gets DEFAULT. Split count is derived, not tuned per shape: enough
splits that B·Hkv·S programs fill the chip (`target_programs`), never more than there are blocks.
"""

from __future__ import annotations

import dataclasses
import os

import jax


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tuning:
    """Launch parameters of the decode kernels on one device kind.

    Attributes:
        block_k: slots per loop step of the full-precision and INT8 kernels (a power of 2 >= 16).
        lowbit_block_k: tokens per loop step of the low-bit kernel (a power of 2).
        lowbit_num_stages: Triton pipelining depth of the low-bit kernel.
        lowbit_stack_pages: the low-bit kernel stacks a step's pages on the padded query rows
            (statistics folded into q) instead of dequantizing keys in registers, when it
            returns no logits (with logits the unstacked kernel is faster: docs/decisions.md).
        lowbit_stacked_pages: most pages per loop step of the stacked low-bit kernel (a power
            of 2; fewer when G query rows per page would overflow its 16-row tile).
        lowbit_asm_unpack: the stacked low-bit kernel converts 2/4-bit codes to bfloat16/float16
            with inline PTX (a LOP3 and a packed FMA per 2 codes) instead of jnp conversions.
        lowbit_tokens_m: the low-bit kernel puts a step's tokens on the dots' M axis (keys
            dequantized in registers as the A operand, `_triton_lowbit_tm.py`); off until timed.
        lowbit_int8_qk_bits: code widths (2, 4) for which the stacked low-bit kernel runs QK
            as an int8 dot by default (q⊙scale per row as int8, the codes unpacked to int8
            with no conversion).
        int8_qk: the INT8 kernel quantizes a bfloat16 q per query head and runs QK as an
            int8 dot (float16/float32 q never: they would lose precision).
        int8_v_words: the INT8 kernel reads value codes as int32 words of 4 channels.
        num_warps: Triton warps per program.
        num_stages: Triton software-pipelining depth.
        target_programs: programs (B·Hkv·S) to aim for; a few waves of the chip's cores.
        int8_target_programs: programs the Triton kernel aims for over an INT8 tier (its
            target: fewer, longer programs than the BF16 kernel's).
        split_min_blocks: fewest blocks (of block_k slots) a split of the Triton dense kernels
            (BF16, INT8) takes: with few sequences (B = 1) the target's splits are short and
            their launch, prologue and combine cost more than the programs they add.
        mgpu_block_k: slots per pipeline step of the Mosaic GPU kernels (a multiple of 64).
        mgpu_stages: blocks the Mosaic GPU kernels keep in flight (TMA copies ahead).
        mgpu_lowbit_pages: 64-token pages a loop step of the Mosaic GPU low-bit kernel reads
            (1 or 2; 2 where the tier's page count is even).
        mgpu_lowbit_fold_keys: bit widths (2, 4) at which the Mosaic GPU low-bit kernel puts
            each page's key statistics on q ((q⊙scale)^T the QK dot's B operand, the zeros'
            share a float32 bias) instead of dequantizing every key code in registers.
        mgpu_lowbit_int4_offset: bit widths at which, with fold_keys and int4 codes, the
            low-bit kernel converts codes as code + 136 (a permute and a LOP3 a pair) and takes
            the offset out through the statistics.
        mgpu_lowbit_one_barrier: bit widths at which the low-bit kernel's five TMA copies of a
            stage arrive on one barrier (one wait a page) instead of five.
        mgpu_lowbit_lean_barriers: bit widths at which the low-bit kernel launches without the
            warpgroup barriers Pallas adds around each shared-memory store and before each TMA
            copy (its own `commit_smem` barriers order every hazard).
        mgpu_lowbit_overlap: bit widths at which the low-bit kernel issues each page's QK dot
            together with the previous page's PV dots and waits for them once.
        mgpu_lowbit_bias_outside: bit widths at which the folded low-bit kernel takes each
            page's key bias computed by XLA before the launch instead of summing it in the loop.
        mgpu_lowbit_tc_bias: bit widths at which the folded low-bit kernel adds each page's
            key bias by two more tensor-core dots (a constant -offset tile, the zero row
            repeated) instead of summing it across the warpgroup's warps.
        mgpu_lowbit_qk_split: bit widths at which the folded low-bit kernel issues each page's
            QK dot as two independent chains (two 64-channel halves, two accumulators).
        mgpu_lowbit_subnormal: bit widths at which the words layout's codes become the low-bit
            kernel's dot operands as subnormal bfloat16s (one AND a register, no offset).
        fused_combine: whether `decode_attention` combines a lone full tier's Triton splits
            with one kernel (`combine_triton`) instead of XLA's ops.
        mgpu_lowbit_words_lop3: whether the words layout's code conversion is written as one
            inline LOP3 a register (else an AND and an OR).
        mgpu_tm_stages: blocks of 64 slots the tokens-on-M Mosaic GPU dense kernel keeps in
            flight.
        mgpu_tm_int8_stages: blocks the slots-on-M kernel keeps in flight over an INT8 tier.
        mgpu_tm_int8_target_programs: CTAs the slots-on-M kernel aims for over an INT8 tier
            (its int8 tiles and one converted tile: several CTAs a multiprocessor).
        mgpu_tm_split_min_blocks: fewest 64-slot blocks a split of the slots-on-M kernel takes
            (as split_min_blocks).
        mgpu_pages_stages: blocks the 8-token-page low-bit kernel (`_mgpu_pages.py`) keeps in
            flight.
        mgpu_pages_target_programs: CTAs the 8-token-page low-bit kernel aims for.
        mgpu_target_programs: CTAs (B·Hkv·S) the Mosaic GPU kernels aim for.
        mgpu_lowbit_target_programs: CTAs the Mosaic GPU low-bit kernel aims for (one wave of
            as many CTAs as its registers let each multiprocessor hold).
        lowbit_cache_layout: the layout a policy's low-bit pages take under `layout="auto"`
            (`CacheSpec.lowbit_layout`): "kernel" where the Mosaic GPU low-bit kernel reads its
            own layout faster than the Triton kernel reads the token-major one, "words" where it
            reads its words layout faster still ("kernel" where only that fits).
        join_new_token: a decode step merges its tiers' split partials and its own token in
            one kernel launch (`join_new_token`) where it applies, instead of XLA's fusions.
        mgpu_tiers: tiers (`MGPU_TIERS`) that `decode_attention` runs through the Mosaic GPU
            kernels on this device (measured faster there); others use Triton. "full" /
            "int8": a full / INT8 tier runs the Mosaic GPU dense kernel
            (`decode_attention_mgpu`) where it applies; "full-tm" / "int8-tm": a bfloat16 full
            tier / an INT8 tier runs the slots-on-M Mosaic GPU kernel
            (`decode_attention_mgpu_tm`) where it applies; "pages": a token-major low-bit tier
            of 8-token pages (QEvict's) runs the Mosaic GPU kernel of 8-token pages
            (`decode_attention_pages_mgpu`) where it applies. Where a named kernel does not
            apply to a tier, the dispatch warns once (naming why) and runs Triton.

    Every field is checked when a Tuning is made (a table entry or a `KVJAX_TUNING` override):
    counts >= 1, block sizes powers of two, bit-width tuples of 2 and 4 only, known tier and
    layout names; anything else is one ValueError naming the field.
    """

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            if isinstance(value, int) and value < 1:
                raise ValueError(f"Tuning.{f.name} must be >= 1, got {value}")
            if f.name in _POWERS_OF_TWO and value & (value - 1):
                raise ValueError(f"Tuning.{f.name} must be a power of 2, got {value}")
            if isinstance(value, tuple) and f.name != "mgpu_tiers":
                bad = [x for x in value if x not in (2, 4)]
                if bad:
                    raise ValueError(
                        f"Tuning.{f.name} lists bit widths of the low-bit tiers (2, 4), "
                        f"got {bad[0]!r}"
                    )
        unknown = [t for t in self.mgpu_tiers if t not in MGPU_TIERS]
        if unknown:
            raise ValueError(
                f"Tuning.mgpu_tiers: unknown tier {unknown[0]!r}; known: {', '.join(MGPU_TIERS)}"
            )
        if self.block_k < 16:
            raise ValueError(f"Tuning.block_k must be >= 16, got {self.block_k}")
        if self.lowbit_cache_layout not in LOWBIT_CACHE_LAYOUTS:
            raise ValueError(
                f"Tuning.lowbit_cache_layout must be one of {LOWBIT_CACHE_LAYOUTS}, "
                f"got {self.lowbit_cache_layout!r}"
            )

    block_k: int = 64
    lowbit_block_k: int = 64
    lowbit_num_stages: int = 2
    lowbit_stack_pages: bool = False
    lowbit_stacked_pages: int = 2
    lowbit_asm_unpack: bool = False
    lowbit_tokens_m: bool = False
    lowbit_int8_qk_bits: tuple[int, ...] = ()
    int8_qk: bool = False
    int8_v_words: bool = False
    num_warps: int = 4
    num_stages: int = 2
    target_programs: int = 512
    int8_target_programs: int = 512
    split_min_blocks: int = 1
    mgpu_block_k: int = 64
    mgpu_stages: int = 2
    mgpu_lowbit_pages: int = 1
    mgpu_lowbit_fold_keys: tuple[int, ...] = ()
    mgpu_lowbit_int4_offset: tuple[int, ...] = ()
    mgpu_lowbit_one_barrier: tuple[int, ...] = ()
    mgpu_lowbit_lean_barriers: tuple[int, ...] = ()
    mgpu_lowbit_overlap: tuple[int, ...] = ()
    mgpu_lowbit_words_lop3: bool = False
    mgpu_lowbit_bias_outside: tuple[int, ...] = ()
    mgpu_lowbit_tc_bias: tuple[int, ...] = ()
    mgpu_lowbit_qk_split: tuple[int, ...] = ()
    mgpu_lowbit_subnormal: tuple[int, ...] = ()
    # On: at B = 1, 32K its one launch (2.76 us) replaces XLA's three (5.5 us), kernels 58.7 ->
    # 56.3 us a call in a profiler trace; the timed loop moved more run to run (67.0-73.2 against
    # 69.2-73.5 us); B = 8 BF16 equal (H100, 2026-12-06; docs/lab/2026-12-06-h100-words-lop3.md).
    fused_combine: bool = True
    mgpu_tm_stages: int = 4
    mgpu_tm_int8_stages: int = 2
    mgpu_tm_int8_target_programs: int = 768
    mgpu_tm_split_min_blocks: int = 1
    mgpu_pages_stages: int = 2
    mgpu_pages_target_programs: int = 768
    mgpu_target_programs: int = 384
    mgpu_lowbit_target_programs: int = 384
    mgpu_tiers: tuple[str, ...] = ()
    join_new_token: bool = False
    lowbit_cache_layout: str = "token"


# The names `Tuning.mgpu_tiers` may hold (see its docstring).
MGPU_TIERS = ("full", "int8", "full-tm", "int8-tm", "pages")
# `CacheSpec.lowbit_layout`'s values (kvjax.cache.LOWBIT_LAYOUTS; test_tuning checks they agree).
LOWBIT_CACHE_LAYOUTS = ("token", "kernel", "words")
_POWERS_OF_TWO = ("block_k", "lowbit_block_k", "lowbit_stacked_pages", "mgpu_block_k")

DEFAULT = Tuning()
# Hopper, from the H200 sweeps (docs/benchmarks.md); the H100 shares the architecture.
_HOPPER = Tuning(
    block_k=64,
    num_warps=4,
    num_stages=3,
    target_programs=1056,
    # The INT8 kernel at 512 programs (8 splits at B = 8, 64 at B = 1) against 1056 (17, 132):
    # B = 8, 16K / 32K / 64K 112.2 / 208.2 / 394.2 -> 106.4 / 199.1 / 378.4 us (1.78x / 1.79x /
    # 1.83x cuDNN BF16); B = 1 24.0 / 39.9 / 64.3 -> 21.1 / 37.7 / 61.6 (H100, 2026-12-07;
    # docs/lab/2026-12-07-h100-card-splits.md). The BF16 kernel keeps 1056: at 8 splits (B = 8,
    # 16K) it ran 188.4 -> 197.4.
    int8_target_programs=512,
    int8_qk=True,
    int8_v_words=True,
    lowbit_stack_pages=True,
    # 4 pages of 32 tokens per step (128): INT4 212.2 -> 179.4 us at B = 8, S = 16K and
    # 382.2 -> 313.0 at 32K, INT2 210.1 -> 166.8 at 16K, though SASS shows 40-72 B of spills
    # (H200, 2026-12-02; docs/lab/2026-12-02-gpu-rows.md).
    lowbit_stacked_pages=4,
    lowbit_asm_unpack=True,
    # QK as an int8 dot: INT4 200.3 -> 171.0 us at B = 8, S = 16K and 305.3 -> 289.6 at 32K;
    # INT2 178.3 -> 183.4 and 300.5 -> 294.2, no gain, so INT4 only (H200, 2026-12-02;
    # docs/lab/2026-12-02-int8qk-lowbit.md).
    lowbit_int8_qk_bits=(4,),
    # The Mosaic GPU kernels ran slower than Triton on every tier they cover (H200, 2026-12-01,
    # B = 8, S = 32K: BF16 328.5 vs 294.7 µs, INT8 315.7 vs 192.5 µs; docs/lab/
    # 2026-12-01-mosaic-kernels.md), so the dispatch keeps Triton here: mgpu_tiers=().
    mgpu_tiers=(),
    # KIVI at 64-token pages, value groups of 64, B = 8, 32K, 8 layers unrolled: the Mosaic GPU
    # kernel over the cache's own int4 pages 181.3 µs a layer at INT4 against Triton's 237.6
    # over bytes (step 3.271 vs 3.707 ms), 189.9 vs 193.3 µs at INT2 (3.373 vs 3.488 ms)
    # (H200, 2026-12-03; docs/lab/2026-12-03-h200-kernel-layout-cache.md). Under the layer
    # scan, read in the stack in place: 32 layers 12.51 / 12.42 ms (INT2 / INT4) against
    # token-major 15.92 / 19.99 (full 14.25).
    # "words" (the codes in the dots' register order): its kernel is faster (B = 8, 16K / 32K /
    # 64K, INT2 81.6 / 147.7 / 283.3 -> 73.8 / 135.1 / 252.6 us, INT4 88.4 / 162.1 / 309.3 ->
    # 83.6 / 151.2 / 289.3), and since its pack is reshapes and one transpose (not a gather)
    # KIVI's step is too: INT2 11.82 / 11.83 -> 11.43 / 11.44 ms, INT4 13.02 -> 11.87 at B = 8,
    # 32K, layer scan, interleaved (H100, 2026-12-06; docs/lab/2026-12-06-h100-words-default.md).
    lowbit_cache_layout="words",
    # INT2 over int4 codes with the key statistics on q, codes read as code + 136 and one
    # barrier a stage: B = 8, 16K / 32K / 64K 124.8 / 251.8 / 387.5 -> 107.7 / 187.7 / 341.5 µs
    # (1.79-1.91x -> 2.07-2.17x cuDNN BF16). INT4 ran slower folded (111.9 / 191.5 / 350.3 ->
    # 117.0-124.3 / 195.1-223.6 / 372.0-384.9), so it keeps its codes dequantized (H100,
    # 2026-12-05; docs/lab/2026-12-05-h100-kernel-knobs.md).
    mgpu_lowbit_fold_keys=(2,),
    # 8 splits at B = 8 (512 CTAs: at 114-124 registers a thread, 4 a multiprocessor, so one
    # wave of 3.9 a multiprocessor instead of 2.9): INT2 104.4 / 190.3 / 344.0 -> 98.0 / 171.1 /
    # 326.0 us at 16K / 32K / 64K, INT4 112.3 / 186.8 / 340.4 -> 104.7 / 175.2 / 334.6; 11
    # splits (two waves) ran slower than 6 (H100, 2026-12-05; docs/lab/
    # 2026-12-05-h100-lowbit-sass.md).
    mgpu_lowbit_target_programs=512,
    mgpu_lowbit_int4_offset=(2,),
    mgpu_lowbit_one_barrier=(2,),
    # The words layout's AND-OR as one inline LOP3 a register (ptxas made it two): B = 8, three
    # interleaved pairs, INT4 227.6-228.2 -> 203.3-212.0 us at 32K and 417.4-429.9 -> 395.8-401.4
    # at 64K; INT2 159.8-172.2 -> 148.5-156.6 and 307.3-309.9 -> 268.3-280.5 (H100, 2026-12-06;
    # docs/lab/2026-12-06-h100-words-lop3.md).
    mgpu_lowbit_words_lop3=True,
    # Each page's QK dot as two chains (two 64-channel halves): INT4 words 195.3 / 195.5 ->
    # 151.4 / 153.3 us at B = 8, 32K (two interleaved pairs); INT2 words and INT2 int4 codes
    # unchanged (135.6 / 135.7 -> 135.1 / 135.9, 149.7 / 148.5 -> 150.8 / 148.6), so INT4 only
    # (it applies to folded keys: the words layout; H100, 2026-12-06; docs/lab/
    # 2026-12-06-h100-timing-loop.md).
    mgpu_lowbit_qk_split=(4,),
    # The words' codes as subnormal bfloat16s (one AND a register, no offset in the key bias
    # or the value zeros' tile): B = 8, 16K / 32K / 64K, INT2 words 73.6 / 134.1 / 256.1 ->
    # 71.0 / 127.6 / 236.1 us, INT4 words 81.9 / 151.5 / 288.5 -> 79.4 / 145.8 / 278.5 (H100,
    # 2026-12-06; docs/lab/2026-12-06-h100-words-default.md).
    mgpu_lowbit_subnormal=(2, 4),
    # Without Pallas' own barriers (the kernel's commit_smem ones order every hazard): on the
    # words layout, B = 8, 32K, three pairs, INT4 147.5-147.8 -> 142.8-144.0 us, INT2
    # 128.4-128.7 -> 126.5-126.8 (H100, 2026-12-07; docs/lab/2026-12-07-h100-card-splits.md;
    # on the byte layout of 2026-12-05 it timed as noise).
    mgpu_lowbit_lean_barriers=(2, 4),
    # A step's tier partials and its own token in one launch, one program a query head (2.8 us
    # a layer where XLA's four fusions took 9.5): B = 8, 32K, layer scan, two interleaved pairs,
    # full 17.88 / 17.87 -> 17.77 / 17.76 ms, window 8.75 / 8.75 -> 8.65 / 8.64, kvpop 8.85 /
    # 8.87 -> 8.76 / 8.76 (H100, 2026-12-07; docs/lab/2026-12-07-h100-join.md).
    join_new_token=True,
    # Splits of at least 16 blocks over an INT8 tier: at B = 1, 32K the 768-CTA target gave 96
    # splits of 5-6 blocks, 48.5 us a call with logits, against 41.9 at 32 splits of 16 (H100,
    # 2026-12-07; docs/lab/2026-12-07-h100-card-splits.md). At B = 8 the target's 12 splits
    # already hold 21+ blocks at 16K and more: the same counts.
    mgpu_tm_split_min_blocks=16,
)
TUNINGS: dict[str, Tuning] = {
    "NVIDIA H200": _HOPPER,
    "NVIDIA H100 80GB HBM3": _HOPPER,
    # interpret mode: few, small programs
    "cpu": Tuning(block_k=16, lowbit_block_k=16, target_programs=4, int8_target_programs=4),
}


ENV = "KVJAX_TUNING"  # field=value[,field=value...]: overrides for A/B runs (e.g. join_new_token=1)


def _overrides(text: str, base: Tuning) -> Tuning:
    """`base` with the fields of "field=value,..." replaced (ints, 0/1 for booleans, tuples
    of names or ints as a+b+c); one clear error names an unknown field or a bad value."""
    fields = {f.name: f for f in dataclasses.fields(Tuning)}
    changes = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq or name not in fields:
            raise ValueError(f"{ENV}: {item!r} is not field=value, field one of {sorted(fields)}")
        current = getattr(base, name)
        try:
            if isinstance(current, bool):
                if value not in ("0", "1"):
                    raise ValueError
                changes[name] = value == "1"
            elif isinstance(current, int):
                changes[name] = int(value)
            elif isinstance(current, tuple):
                parts = [p for p in value.split("+") if p]
                changes[name] = tuple(int(p) if p.isdigit() else p for p in parts)
            else:
                changes[name] = value
        except ValueError:
            raise ValueError(f"{ENV}: bad value {value!r} for {name} (now {current!r})") from None
    try:
        return dataclasses.replace(base, **changes)
    except ValueError as e:  # a value of the right type the field does not take
        raise ValueError(f"{ENV}: {e}") from None


def tuning_overrides() -> str:
    """The `KVJAX_TUNING` overrides this process runs under ("" when none), as the bench rows
    record them (an A/B run's rows then say which side they are)."""
    return ",".join(x.strip() for x in os.environ.get(ENV, "").split(",") if x.strip())


def tuning_for(device_kind: str | None = None) -> Tuning:
    """The tuning of `device_kind` (default: the first device's), else DEFAULT; with the
    environment variable KVJAX_TUNING="field=value,..." overriding fields (A/B runs)."""
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    base = TUNINGS.get(device_kind, DEFAULT)
    text = tuning_overrides()
    return _overrides(text, base) if text else base


def num_splits(
    batch: int, kv_heads: int, num_blocks: int, target_programs: int, min_blocks: int = 1
) -> int:
    """S: splits per (sequence, KV head) so that batch·kv_heads·S ≈ target_programs, each
    split at least `min_blocks` blocks long (one split when the tier has fewer).

    Args:
        batch: B.
        kv_heads: Hkv.
        num_blocks: loop steps of a whole tier (static capacity / block).
        target_programs: programs to aim for.
        min_blocks: fewest blocks a split takes (>= 1).
    """
    if min(batch, kv_heads, target_programs, min_blocks) < 1 or num_blocks < 0:
        raise ValueError(
            "num_splits: batch, kv_heads, target_programs and min_blocks must be >= 1 and "
            f"num_blocks >= 0, got {(batch, kv_heads, num_blocks, target_programs, min_blocks)}"
        )
    want = -(-target_programs // (batch * kv_heads))
    return max(1, min(want, num_blocks // min_blocks))
