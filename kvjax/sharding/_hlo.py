"""Collectives read from compiled (partitioned) HLO text: what a sharded step communicates."""

from __future__ import annotations

import re

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
)
# `%name = f32[8,16]{1,0} all-reduce(` or the async `all-gather-start(`; tuple results too.
_INSTR = re.compile(
    r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(",
)
_ARRAY = re.compile(r"(\w+)\[([0-9,]*)\]")


def collectives(hlo_text: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """Every collective instruction of compiled HLO as (opcode, dtype, per-device result shape);
    a collective over a tuple yields one entry per array. `-done` halves are not counted."""
    found = []
    for line in hlo_text.splitlines():
        m = _INSTR.search(line)
        if not m:
            continue
        for dtype, dims in _ARRAY.findall(m.group(1)):
            found.append((m.group(2), dtype, tuple(int(d) for d in dims.split(",") if d)))
    return found


def large_collectives(
    hlo_text: str, shapes: set[tuple[int, ...]], opcodes: tuple[str, ...] = COLLECTIVES
) -> list[str]:
    """Collectives (of `opcodes`) whose result has one of `shapes` (e.g. a cache tier's global
    or per-device K/V shape), as "opcode dtype[dims]" strings: a sharded decode step holds
    none."""
    return [
        f"{op} {dtype}{list(shape)}"
        for op, dtype, shape in collectives(hlo_text)
        if op in opcodes and shape in shapes
    ]
