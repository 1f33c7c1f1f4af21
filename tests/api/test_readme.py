"""The README's quick tour, run verbatim on the embedded model, and the acceptance call: a chat
question through a StreamingLLM cache of 128 tokens answers Paris, with no stop token in the
text."""

import contextlib
import io
import pathlib
import re

import pytest

import kvjax

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"

pytestmark = pytest.mark.slow


def quick_tour() -> str:
    """The first ```python block under "## Quick tour" in README.md."""
    section = README.read_text(encoding="utf-8").split("## Quick tour", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def tour():
    code, namespace, printed = quick_tour(), {}, io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), namespace)
    return code, namespace, printed.getvalue()


def test_quick_tour_runs_verbatim(tour):
    code, ns, printed = tour
    assert len(code.strip().splitlines()) <= 12
    assert "Paris" in ns["out"].text
    assert ns["out"].telemetry.live_bytes().max() > 0
    lines = printed.splitlines()
    assert lines[0] == ns["out"].text and float(lines[-1]) > 1.0
    assert "<|im_end|>" not in printed and "<|im_start|>" not in printed
    assert ns["reply"].policy == kvjax.policies.H2OPolicy(budget=64)


def test_capital_of_france_through_a_streaming_cache(tour):
    out = kvjax.load().generate(
        "What is the capital of France?", chat=True, policy="streaming", budget=128
    )
    assert "Paris" in out.text and out.finish_reason == "stop"
    assert "<|im_end|>" not in out.text and 2 not in out.tokens  # 2 = <|im_end|>
    assert out.text == tour[1]["out"].text
