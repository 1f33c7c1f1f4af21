"""NIAH: needle placement, scoring, grid/JSON structure, protocols, outputs, bad input.

Fast tests run the tiny random Llama with a character-level fake tokenizer (id = ASCII code, so
one character is one token and '.' is its own token); one slow test runs SmolLM2 on one cell.
"""

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax_events import COMPILE, count_events

from kvjax.cli import main
from kvjax.eval import (
    NEEDLE,
    NiahProtocol,
    build_niah_prompt,
    check_niah_grid,
    insert_needle,
    niah_summary_rows,
    read_niah_result,
    run_niah,
    score_niah_answer,
    write_niah_outputs,
)
from kvjax.eval._niah_plot import niah_stem
from kvjax.generate import GenerateConfig, generate
from kvjax.policies import make_policy
from kvjax.weights import LoadedModel

EOS = 3


class CharTokenizer:
    """One token per ASCII character; id 3 (a control character) is the end of turn."""

    eos_ids = (EOS,)

    def encode(self, text: str) -> list[int]:
        return [ord(c) if ord(c) < 128 else ord("?") for c in text]

    def decode(self, ids, skip_special: bool = False) -> str:
        return "".join(chr(int(i)) for i in ids if not (skip_special and int(i) == EOS))

    def apply_chat_template(self, messages) -> str:
        return "".join(f"<{m['role']}>{m['content']}\x03" for m in messages) + "<assistant>"


HAYSTACK = " ".join(f"Essay sentence number {i} says a thing or two." for i in range(200))
NEEDLE_TOKENS = len(" " + NEEDLE)  # 97 characters


@pytest.fixture(scope="module")
def tiny_model(tiny_llama):
    config, params = tiny_llama
    return LoadedModel(config=config, params=params, tokenizer=CharTokenizer(), source="tiny")


def _run(model, protocol, *, policy="full", budget=None, lengths=(384, 512), depths=(0, 50, 100)):
    return run_niah(
        model,
        make_policy(policy, budget),
        lengths=list(lengths),
        depths=list(depths),
        protocol=protocol,
        budget=budget,
        max_new_tokens=6,
        chunk_size=128,
        haystack=HAYSTACK,
    )


@pytest.fixture(scope="module")
def aware(tiny_model):
    return _run(tiny_model, "query-aware")


@pytest.fixture(scope="module")
def agnostic(tiny_model):
    return _run(tiny_model, NiahProtocol.QUERY_AGNOSTIC)


def test_insert_needle_golden():
    # 10 tokens, sentence ends ('.' = 0) after indices 2 and 6: boundaries at 3 and 7.
    hay = [5, 5, 0, 5, 5, 5, 0, 5, 5, 5]
    ends = (0).__eq__
    assert insert_needle(hay, [9, 9], 0, ends)[1] == 0
    assert insert_needle(hay, [9, 9], 60, ends)[1] == 3  # ⌊10·0.6⌋ = 6 → back to 3
    assert insert_needle(hay, [9, 9], 70, ends)[1] == 7  # 7 itself is a boundary
    assert insert_needle(hay, [9, 9], 25, ends)[1] == 0  # ⌊2.5⌋ = 2, no end before it
    out, at = insert_needle(hay, [9, 9], 100, ends)  # 100%: appended at the very end
    assert at == 10 and out == [*hay, 9, 9]


@given(
    hay=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    depth=st.floats(0, 100, allow_nan=False),
)
def test_insert_needle_properties(hay, depth):
    ends = (0).__eq__
    needle = [7, 8, 9]
    out, at = insert_needle(hay, needle, depth, ends)
    target = len(hay) if depth == 100 else math.floor(len(hay) * depth / 100)
    assert at <= target
    assert out == [*hay[:at], *needle, *hay[at:]]  # every token kept, in order
    if depth < 100:
        assert at == 0 or ends(hay[at - 1])
        assert not any(ends(hay[j - 1]) for j in range(at + 1, target + 1))  # the last one


def test_build_prompt_token_layout():
    tok = CharTokenizer()
    hay = tok.encode(HAYSTACK)
    p = build_niah_prompt(tok, hay, length=512, depth=50)
    head = tok.encode("<user>")
    needle = tok.encode(" " + NEEDLE)
    n = 512 - 200 - len(needle)
    assert p.context[: len(head)] == head
    body = p.context[len(head) :]
    at = p.needle_start - len(head)
    assert len(body) == 512 - 200  # haystack + needle fill length − buffer
    assert body[at : at + len(needle)] == needle
    assert body[:at] + body[at + len(needle) :] == hay[:n]  # haystack untouched
    assert body[at - 1] == ord(".") and at <= n // 2
    assert p.needle_depth == pytest.approx(100 * at / n)
    assert tok.decode(p.question).startswith("\n\nWhat is the best thing to do in San Francisco?")
    assert tok.decode(p.question).endswith("\x03<assistant>")


@pytest.mark.parametrize(
    "answer,score,soft",
    [
        ("The best thing is to eat a sandwich and sit in Dolores Park.", 1.0, 5 / 7),
        ("Eat a SANDWICH in dolores\n  park on a sunny day", 1.0, 6 / 7),  # case, whitespace
        ("sandwiches in Dolores Park", 1.0, 2 / 7),  # substrings: 'sandwich' ⊂ 'sandwiches'
        ("Sit in Dolores Park on a sunny day.", 0.0, 5 / 7),  # no sandwich
        ("eat a sandwich in DoloresPark", 0.0, 2 / 7),  # 'dolores park' needs the space
        ("The best thing to do in San Francisco", 0.0, 0.0),  # echoing the question earns nothing
        ("", 0.0, 0.0),
    ],
)
def test_scoring_rule(answer, score, soft):
    assert score_niah_answer(answer) == (score, pytest.approx(soft))


def test_grid_and_json_structure(aware):
    assert aware.protocol == "query-aware" and aware.policy == "full" and aware.budget is None
    assert [(c.length, c.depth) for c in aware.cells] == [
        (n, d) for n in (384, 512) for d in (0.0, 50.0, 100.0)
    ]
    assert set(aware.mean_score_by_length) == {"384", "512"}
    data = json.loads(json.dumps(dataclasses.asdict(aware)))
    cell = data["cells"][0]
    assert set(cell) >= {
        "length",
        "depth",
        "score",
        "soft_score",
        "answer",
        "prompt_tokens",
        "live_kv_bytes",
    }
    for c in aware.cells:
        assert c.prompt_tokens <= c.length - 6  # prompt + answer fit in the context length
        assert 1 <= len(c.answer_tokens) <= 6
        # full keeps every written token: the prompt and each answer token but a final stop;
        # live bytes count what the last step attends, those plus its current token.
        written = c.prompt_tokens + len(c.answer_tokens) - (c.answer_tokens[-1] == EOS)
        assert c.live_kv_bytes == (written + 1) * 2 * 2 * 16 * 2 * 4  # L·Hkv·D·(K,V)·float32


def test_full_cache_protocols_agree(aware, agnostic):
    assert agnostic.protocol == "query-agnostic"
    assert [c.answer_tokens for c in aware.cells] == [c.answer_tokens for c in agnostic.cells]
    assert [c.live_kv_bytes for c in aware.cells] == [c.live_kv_bytes for c in agnostic.cells]


def test_generate_from_cache_matches_generate(tiny_model, aware):
    # The query-aware cell (length 384, depth 50) through `kvjax.generate.generate`.
    p = build_niah_prompt(
        tiny_model.tokenizer, tiny_model.tokenizer.encode(HAYSTACK), length=384, depth=50
    )
    gen = GenerateConfig(max_new_tokens=6, stop_tokens=(EOS,), chunk_size=128)
    ref = generate(
        tiny_model.config,
        tiny_model.params,
        [p.context + p.question],
        policy=make_policy("full"),
        gen=gen,
    )
    n = int(ref.num_generated[0])
    assert np.asarray(ref.tokens)[0, :n].tolist() == aware.cells[1].answer_tokens


def test_budgeted_policy(tiny_model):
    r = _run(tiny_model, "query-agnostic", policy="window", budget=64, lengths=(384,), depths=(50,))
    assert r.budget == 64 and r.policy == "window"
    assert r.cells[0].live_kv_bytes == 64 * 2 * 2 * 16 * 2 * 4  # the window is full


def test_a_ratio_runs_each_length_at_its_own_budget(tiny_model):
    """policy as a function of the length (a compression ratio): each length's cells equal a run
    of that length alone at floor((1 - ratio) * length), the per-length budgets and the ratio are
    in the result and its file name."""
    from kvjax._budget import budget_from_compression

    ratio, lengths = 0.75, (384, 512)
    r = run_niah(
        tiny_model,
        lambda n: make_policy("window", budget_from_compression(ratio, n)),
        lengths=list(lengths),
        depths=[50],
        protocol="query-agnostic",
        ratio=ratio,
        max_new_tokens=6,
        chunk_size=128,
        haystack=HAYSTACK,
    )
    assert r.ratio == ratio and r.budgets == {"384": 96, "512": 128} and r.budget is None
    for cell, n in zip(r.cells, lengths, strict=True):
        window = dict(policy="window", budget=n // 4, lengths=(n,), depths=(50,))
        ref = _run(tiny_model, "query-agnostic", **window).cells[0]
        assert (cell.answer_tokens, cell.live_kv_bytes) == (ref.answer_tokens, ref.live_kv_bytes)
        assert cell.live_kv_bytes == (n // 4) * 2 * 2 * 16 * 2 * 4  # the window is full
    assert niah_stem(r) == "window-r0.75_query-agnostic"
    assert niah_summary_rows([r])[0]["ratio"] == ratio


def test_lengths_of_one_cache_shape_share_one_compiled_step(tiny_model):
    """A bounded cache has one shape at every length above its budget: a grid over two such
    lengths compiles what one length compiles (prompts padded to one bucket), and its cells
    equal those of each length run alone (before, each length compiled its own step)."""
    import jax

    run = lambda lengths, **kw: _run(
        tiny_model, "query-agnostic", lengths=lengths, depths=(50,), **kw
    )
    window = dict(policy="window", budget=64)
    jax.clear_caches()
    one = count_events(COMPILE, lambda: run((384,), **window))
    jax.clear_caches()
    both = []
    two = count_events(COMPILE, lambda: both.append(run((384, 512), **window)))
    assert 0 < one == two, (one, two)
    alone = run((512,), **window)
    for cell, ref in zip(
        both[0].cells, [run((384,), **window).cells[0], alone.cells[0]], strict=True
    ):
        assert (cell.answer_tokens, cell.live_kv_bytes) == (ref.answer_tokens, ref.live_kv_bytes)


@pytest.mark.parametrize("protocol", [NiahProtocol.QUERY_AWARE, NiahProtocol.QUERY_AGNOSTIC])
def test_scanned_grid_equals_unrolled(tiny_model, protocol):
    """scan_layers: a stacked cache and stacked params, the same answers, scores and live bytes
    as the unrolled grid, for a ratio's per-length policies."""
    from kvjax._budget import budget_from_compression

    for name in ("streaming", "h2o"):
        run = lambda scan, name=name: run_niah(
            tiny_model,
            lambda n: make_policy(name, budget_from_compression(0.75, n)),
            lengths=[384],
            depths=[0, 100],
            protocol=protocol,
            ratio=0.75,
            max_new_tokens=6,
            chunk_size=128,
            haystack=HAYSTACK,
            scan_layers=scan,
        )
        fields = lambda r: [
            (c.answer_tokens, c.answer, c.score, c.soft_score, c.live_kv_bytes) for c in r.cells
        ]
        scanned, unrolled = run(True), run(False)
        assert fields(scanned) == fields(unrolled), name
        assert scanned.cells[0].live_kv_bytes == 96 * 2 * 2 * 16 * 2 * 4  # the budget is full


def test_scan_layers_refuses_per_layer_budgets(tiny_model):
    layers = tiny_model.config.num_layers
    pyramid = make_policy("pyramidkv", 128, num_layers=layers, beta=2, window=16, observation=16)
    assert not pyramid.scans_layers()  # layer budgets 192 and 64
    with pytest.raises(ValueError, match="cannot run in a layer scan"):
        run_niah(
            tiny_model,
            pyramid,
            lengths=[384],
            depths=[50],
            protocol="query-aware",
            haystack=HAYSTACK,
            scan_layers=True,
            on_cell=lambda _: pytest.fail("a cell ran"),
        )


TOKEN_BYTES = 2 * 2 * 16 * 2 * 4  # L·Hkv·D·(K,V)·float32 of the tiny Llama


def _written(c):
    """Tokens a cell's answer wrote into the cache (a final stop token is not written)."""
    return len(c.answer_tokens) - (c.answer_tokens[-1] == EOS)


def test_press_full_cache_equals_the_bounded_protocols(tiny_model, agnostic):
    """kvpress's protocol with the full cache keeps everything: the answers and live bytes of
    the bounded protocols."""
    pressed = _run(tiny_model, NiahProtocol.PRESS)
    assert pressed.protocol == "press"
    assert [c.answer_tokens for c in pressed.cells] == [c.answer_tokens for c in agnostic.cells]
    assert [c.live_kv_bytes for c in pressed.cells] == [c.live_kv_bytes for c in agnostic.cells]


@pytest.mark.parametrize("policy", ["window", "h2o", "kvzip", "expected", "adakv-kvzip"])
def test_press_keeps_budget_minus_one_context_tokens_then_appends(tiny_model, policy):
    """Under `press` the context is compressed once to budget − 1 tokens per KV head, then the
    question and the answer append without evicting: live bytes = those + the current token.
    (Under query-agnostic the same budget bounds the whole cache.) kvzip runs its
    reconstruction passes (their prompts from the tokenizer), adakv-kvzip pools them."""
    budget = 96
    kw = {"num_layers": tiny_model.config.num_layers}
    r = run_niah(
        tiny_model,
        make_policy(policy, budget, **(kw if policy.startswith("adakv") else {})),
        lengths=[384],
        depths=[0, 100],
        protocol="press",
        max_new_tokens=6,
        chunk_size=128,
        haystack=HAYSTACK,
    )
    p = build_niah_prompt(
        tiny_model.tokenizer, tiny_model.tokenizer.encode(HAYSTACK), length=384, depth=0
    )
    for c in r.cells:
        kept = budget - 1 + len(p.question) + _written(c)
        assert c.live_kv_bytes == (kept + 1) * TOKEN_BYTES, policy
    bounded = _run(tiny_model, "query-agnostic", policy="window", budget=budget, lengths=(384,))
    assert bounded.cells[0].live_kv_bytes == budget * TOKEN_BYTES


@pytest.mark.parametrize("policy,budget", [("kivi", None), ("qevict", 128), ("confkv", 256)])
def test_press_refuses_tiered_policies_before_any_cell(tiny_model, policy, budget):
    with pytest.raises(ValueError, match=f"policy '{policy}' is tiered"):
        run_niah(
            tiny_model,
            make_policy(policy, budget),
            lengths=[384],
            depths=[50],
            protocol="press",
            haystack=HAYSTACK,
            on_cell=lambda _: pytest.fail("a cell ran"),
        )


@pytest.mark.parametrize("policy", ["kvzip", "expected", "adakv-kvzip"])
@pytest.mark.parametrize("protocol", ["query-aware", "query-agnostic"])
def test_bounded_protocols_refuse_press_scored_policies(tiny_model, policy, protocol):
    """kvzip/expected score only in press_context: in a bounded cache they would keep the first
    tokens and drop the question (every answer wrong), so they are refused, naming `press`."""
    kw = {"num_layers": tiny_model.config.num_layers} if policy.startswith("adakv") else {}
    with pytest.raises(ValueError, match="run it under protocol 'press'"):
        run_niah(
            tiny_model,
            make_policy(policy, 128, **kw),
            lengths=[384],
            depths=[50],
            protocol=protocol,
            haystack=HAYSTACK,
            on_cell=lambda _: pytest.fail("a cell ran"),
        )


def test_press_refuses_stacked_params(tiny_model):
    from kvjax.models import stack_params

    stacked = dataclasses.replace(tiny_model, params=stack_params(tiny_model.params))
    with pytest.raises(ValueError, match="per-layer params"):
        run_niah(stacked, make_policy("full"), lengths=[384], depths=[50], protocol="press")


def test_outputs_written(aware, tmp_path):
    json_path, png_path = write_niah_outputs(aware, tmp_path / "out")
    assert json_path.endswith("full_query-aware.json") and png_path.endswith(".png")
    with open(png_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert read_niah_result(json_path) == aware  # JSON round trip


@pytest.mark.parametrize(
    "lengths,depths,match",
    [
        ([1024], [101], "outside"),
        ([1024], [-1], "outside"),
        ([200], [50], "buffer"),
        ([], [50], "at least one"),
        ([1024], [], "at least one"),
        ([1024, 1024], [0], "repeated"),
    ],
)
def test_bad_grid(lengths, depths, match):
    with pytest.raises(ValueError, match=match):
        check_niah_grid(lengths, depths)


def test_bad_run_input(tiny_model):
    with pytest.raises(ValueError, match="unknown protocol"):
        _run(tiny_model, "sideways")
    with pytest.raises(ValueError, match="no room for the haystack"):
        _run(tiny_model, "query-aware", lengths=(250,))  # 250 − 200 < the 97-token needle
    with pytest.raises(ValueError, match="haystack has only"):
        _run(tiny_model, "query-aware", lengths=(1 << 16,))
    with pytest.raises(ValueError, match="buffer"):
        run_niah(
            tiny_model,
            make_policy("full"),
            lengths=[512],
            depths=[0],
            protocol="query-aware",
            max_new_tokens=150,
            haystack=HAYSTACK,
        )


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--policy", "bogus"], "unknown policy"),
        (["--policy", "kivi", "--protocol", "press"], "policy 'kivi' is tiered"),
        (["--policy", "window"], "needs a budget"),
        (["--depths", "120"], "outside"),
        (["--lengths", "150"], "buffer"),
        (["--policy", "h2o", "--ratios", "0.5", "--budget", "64"], "not both"),
        (["--policy", "h2o", "--ratios", "1.5"], "--ratios 1.5: compression must be in [0, 1)"),
        (
            ["--policy", "streaming", "--sinks", "300", "--ratios", "0.75", "--lengths", "1024"],
            "--ratios 0.75 of a 1024-token context gives streaming a budget of 256 tokens",
        ),
    ],
)
def test_cli_bad_input(argv, match, capsys):
    assert main(["niah", *argv]) == 2
    assert match in capsys.readouterr().err


def test_cli_scan_layers_refuses_pyramidkv_before_any_cell(tiny_model, monkeypatch, capsys):
    """pyramidkv's per-layer budgets need the model's layer count: --scan-layers is refused
    once the model loads (here the tiny one, 2 layers), before any cell runs."""
    import os

    import kvjax.cli._niah as niah_cli
    import kvjax.eval

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # --scan-layers adds one
    monkeypatch.setattr(niah_cli, "load", lambda args: tiny_model)
    monkeypatch.setattr(kvjax.eval, "run_niah", lambda *a, **k: pytest.fail("a cell ran"))
    argv = ["--policy", "full", "pyramidkv", "--ratios", "0.5", "--lengths", "4096"]
    assert main(["niah", *argv, "--scan-layers"]) == 2  # budget 2048: layers of 3994 and 102
    assert "--scan-layers: policy 'pyramidkv'" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm_finds_needle_at_1k(smollm):
    r = run_niah(smollm, make_policy("full"), lengths=[1024], depths=[50], protocol="query-aware")
    assert r.cells[0].score == 1.0, r.cells[0].answer


def test_cli_ratios_run_each_budgeted_policy_per_ratio_and_full_once():
    from kvjax.cli import build_parser
    from kvjax.cli._niah import _at_ratio, _runs

    args = build_parser().parse_args(
        ["niah", "--policy", "full", "h2o", "--ratios", "0.5", "0.875", "--lengths", "1024"]
    )
    assert _runs(args) == [("full", None), ("h2o", 0.5), ("h2o", 0.875)]
    assert not args.scan_layers
    assert build_parser().parse_args(["niah", "--scan-layers"]).scan_layers
    assert _at_ratio("h2o", 0.875, args)(1024).budget == 128
    assert _at_ratio("h2o", 0.5, args)(2048).budget == 1024
    # `adakv-<press>` names (as `kvjax ruler`'s rows) build adakv over that press
    args = build_parser().parse_args(
        ["niah", "--policy", "adakv-keydiff", "--ratios", "0.75", "--lengths", "1024"]
    )
    assert _runs(args) == [("adakv-keydiff", 0.75)]
    p = _at_ratio("adakv-keydiff", 0.75, args)(1024)
    assert (p.name, p.press.name, p.budget) == ("adakv", "keydiff", 256)
