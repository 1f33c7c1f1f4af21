"""The CPU evaluation scripts give CONF-KV (INT8) the budget whose peak live bytes match a
bf16 budget of the other policies, as `kvjax compare` matches them: the budgets written in the
scripts must be what `matched_budget` finds today (the budget definition moved once already)."""

import pathlib
import re

import pytest

from kvjax.eval._compare import ROWS, matched_budget, policy_peak_bytes
from kvjax.models import PRESETS
from kvjax.policies import make_policy

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"
CFG = PRESETS["SmolLM2-135M"]


def _pairs(script: str) -> list[tuple[int, int]]:
    """The `for pb in "B C" ...` pairs: (bf16 budget, CONF-KV's matched budget)."""
    text = (SCRIPTS / script).read_text()
    loop = re.search(r"for pb in ((?:\"\d+ \d+\" ?)+); do", text)
    assert loop, f'{script}: no `for pb in "B C" ...` loop'
    return [tuple(map(int, p.split())) for p in re.findall(r"\"(\d+ \d+)\"", loop.group(1))]


@pytest.mark.parametrize("script", ["qevict_niah_cpu.sh", "kvpop_eval_cpu.sh"])
def test_confkv_budgets_in_the_scripts_match_peak_bytes(script):
    name, kw = ROWS["confkv+int8"]
    make = lambda b: make_policy(name, b, num_layers=CFG.num_layers, **kw)
    pairs = _pairs(script)
    assert len(pairs) >= 2
    for bf16, written in pairs:
        target = policy_peak_bytes(make_policy("window", bf16), CFG, 2048, 2)
        assert written == matched_budget(make, CFG, target, 2, max_tokens=2048), (script, bf16)
