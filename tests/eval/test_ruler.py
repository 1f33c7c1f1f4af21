"""RULER-style tasks: prompts at the target length with the real SmolLM2 tokenizer, each answer
where it should be, string_match_all on hand-made answers, and the run through the tiny model."""

import collections
import dataclasses
import json
import pathlib
import re

import pytest
from jax_events import LOWERING, count_events

from kvjax.cli import main
from kvjax.eval import (
    RULER_TASKS,
    adakv_presses,
    build_sample,
    ruler_policy,
    ruler_summary,
    run_ruler,
    string_match_all,
    write_ruler_outputs,
)
from kvjax.policies import AdaKVPolicy, make_policy
from kvjax.weights import LoadedModel, Tokenizer
from kvjax.weights._locate import default_model_path


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def tiny_model(tiny_llama, tok):
    """The tiny random model behind the real tokenizer's text (ids folded into its vocabulary;
    its answers are noise)."""
    config, params = tiny_llama

    class Small:
        def encode(self, text):
            return [i % config.vocab_size for i in tok.encode(text)]

        def decode(self, ids, skip_special=False):
            return tok.decode(ids, skip_special=skip_special)

        def apply_chat_template(self, messages):
            return tok.apply_chat_template(messages)

    return LoadedModel(config=config, params=params, tokenizer=Small(), source="tiny")


@pytest.mark.parametrize("task", list(RULER_TASKS))
@pytest.mark.parametrize("length", [1024, 2048])
def test_prompt_is_the_target_length_and_seeded(tok, task, length):
    s = build_sample(tok, task, length, seed=3)
    n = len(s.context) + len(s.question)
    assert abs(n - length) <= 0.01 * length
    # every sample of a (task, length) has the same context length (one compile per cell)
    assert {len(build_sample(tok, task, length, i).context) for i in range(4)} == {len(s.context)}
    again = build_sample(tok, task, length, seed=3)
    assert (again.context, again.answers) == (s.context, s.answers)
    other = build_sample(tok, task, length, seed=4)
    assert other.context != s.context


@pytest.mark.parametrize("task", [t for t in RULER_TASKS if t.startswith("niah")])
def test_niah_answers_are_in_the_context_exactly_once_at_their_needles(tok, task):
    for seed in range(3):
        s = build_sample(tok, task, 1024, seed)
        text, question = tok.decode(s.context), tok.decode(s.question)
        for start, ids in s.needles:
            assert s.context[start : start + len(ids)] == ids
        needles = [tok.decode(ids) for _, ids in s.needles]
        for a in s.answers:
            assert text.count(a) == 1
            # ... inside the needle of a queried key
            (hit,) = [n for n in needles if a in n]
            key = re.search(r"for (\S+) is:", hit).group(1)
            assert key in question
        n_keys, n_values, n_query = RULER_TASKS[task][3:]
        assert len(s.needles) == n_keys * n_values
        assert len(s.answers) == n_query * n_values
        for key in re.findall(r"for (\S+) is:", " ".join(needles)):
            assert text.count(f"for {key} is:") == n_values  # distractors have other keys


def test_vt_chain_is_in_order_and_the_value_once(tok):
    s = build_sample(tok, "vt", 1024, 0)
    text = tok.decode(s.context)
    value = re.search(r"the value (\d+)", tok.decode(s.question)).group(1)
    assert text.count(value) == 1
    starts = [a for a, _ in s.needles]
    assert starts == sorted(starts) and len(s.answers) == 5
    stmts = [tok.decode(ids).strip() for _, ids in s.needles]
    assert stmts[0] == f"VAR {s.answers[0]} = {value}."
    for a, b, st in zip(s.answers, s.answers[1:], stmts[1:], strict=False):
        assert st == f"VAR {b} = VAR {a}."


def test_cwe_and_fwe_answers_are_the_most_frequent_words(tok):
    cwe = build_sample(tok, "cwe", 1024, 1)
    words = collections.Counter(re.findall(r"\d+\. (\w+)", tok.decode(cwe.context)))
    top = {w for w, _ in words.most_common(10)}
    assert top == set(cwe.answers)
    assert min(words[w] for w in top) > max(c for w, c in words.items() if w not in top)
    fwe = build_sample(tok, "fwe", 1024, 1)
    body = tok.decode(fwe.context).split("coded words. ")[-1]
    counts = collections.Counter(w for w in body.split() if w != "....")
    ranked = counts.most_common()
    assert [w for w, _ in ranked[:3]] == fwe.answers
    assert ranked[2][1] > ranked[3][1]


def test_string_match_all_on_hand_made_answers():
    refs = [["1234567", "7654321"], ["abc-def"], ["x1", "y2", "z3", "w4"]]
    preds = ["The numbers are 7654321 and 1234567.", "ABC-DEF", "x1 and z3"]
    assert string_match_all(preds, refs) == pytest.approx(100 * (1 + 1 + 0.5) / 3)
    assert string_match_all(["none"], [["7"]]) == 0
    with pytest.raises(ValueError, match="predictions"):
        string_match_all(["a"], [["a"], ["b"]])


def test_bad_input_is_named(tok):
    with pytest.raises(ValueError, match="unknown RULER task"):
        build_sample(tok, "niah_single_9", 1024, 0)
    with pytest.raises(ValueError, match="cannot fit"):
        build_sample(tok, "niah_multiquery", 60, 0)
    assert main(["ruler", "--policy", "nope", "--lengths", "512"]) == 2
    assert main(["ruler", "--ratios", "1.5"]) == 2


@pytest.mark.parametrize("press", ["snapkv", "kvzip", "pyramidkv", "keydiff"])
def test_adakv_press_is_spelled_in_the_policy_name(press):
    """`adakv-PRESS` = adakv over PRESS at the ruler's budget, each with its own defaults (the
    same policy as `make_policy("adakv", N, press=PRESS)`), the model's layer count passed on
    (PyramidKV's pyramid is on at N = 2000: round(2000 / 20) > its window 64)."""
    got = ruler_policy(f"adakv-{press}", 2000, 4)
    assert isinstance(got, AdaKVPolicy) and got.press.name == press
    assert got == make_policy("adakv", 2000, press=press, num_layers=4)
    assert got.press == make_policy(press, 2000, num_layers=4)
    budgets = [got.max_budget(li) for li in range(4)]
    assert (budgets[0] > budgets[-1]) == (press == "pyramidkv")
    assert ruler_policy(press, 2000, 4) == got.press  # the plain names are unchanged
    assert ruler_policy("adakv", 2000, 4).press.name == "snapkv"  # adakv's default press


def test_adakv_presses_are_the_ones_it_wraps():
    """Every listed press builds under adakv; every other budgeted registry name is refused by
    AdaKVPolicy itself (tiered, budget-adaptive, own writes, or not ranked)."""
    from kvjax.policies import BUDGETLESS, POLICIES

    assert {"snapkv", "kvzip", "expected", "h2o"} <= set(adakv_presses())
    for name in sorted(set(POLICIES) - set(adakv_presses()) - BUDGETLESS - {"adakv"}):
        with pytest.raises(ValueError, match="AdaKVPolicy"):
            AdaKVPolicy(press=make_policy(name, 4096, num_layers=2))
        with pytest.raises(ValueError, match=f"'{name}' is not a press adakv wraps"):
            ruler_policy(f"adakv-{name}", 4096, 2)


def test_run_ruler_through_the_tiny_model(tiny_model, tmp_path):
    """The pipeline on the tiny random model (its answers are noise): rows per policy × ratio,
    each score = string_match_all of its own answers; JSON and PNG written."""
    model = tiny_model
    names = ["full", "snapkv", "kvzip", "adakv", "adakv-kvzip"]
    seen = []  # what on_row saw after each cell: the rows so far, one more each time
    rows = run_ruler(model, names, tasks=["niah_single_1"], lengths=[300],
                     ratios=[0.5], samples=1, max_new_tokens=4,
                     on_row=seen.append)  # fmt: skip
    assert [(r.policy, r.ratio) for r in rows] == [("full", 0.0)] + [(n, 0.5) for n in names[1:]]
    assert [len(s) for s in seen] == list(range(1, len(rows) + 1)) and seen[-1] == rows
    sample = build_sample(model.tokenizer, "niah_single_1", 300, 0)
    for r in rows:
        assert r.score == string_match_all(r.answers, [sample.answers])
        s = len(sample.context)
        assert r.kept_tokens == (s if r.policy == "full" else int(s * 0.5))  # kvpress's count
    j, png = write_ruler_outputs(rows, str(tmp_path), {"model": "tiny", "lengths": [300]})
    assert json.loads(pathlib.Path(j).read_text())["rows"][1]["policy"] == "snapkv"
    assert pathlib.Path(png).read_bytes()[:4] == b"\x89PNG"
    assert [s["policy"] for s in ruler_summary(rows)] == names


def test_cells_of_one_length_share_one_compiled_generate(tiny_model):
    """Questions a few tokens apart and different ratios decode with one compiled generate
    step (the append cache is padded to one bucket); a question past the next 64-token chunk
    compiles a new one."""
    from kvjax.eval._ruler import answer, answer_room
    from kvjax.generate import generate_from_cache

    assert [answer_room(q, 32) for q in (14, 15, 16, 40, 42)] == [48, 48, 64, 80, 80]
    model = tiny_model
    built = build_sample(model.tokenizer, "niah_single_1", 300, 0)
    words = list(built.question) * 8
    assert len(words) > 70
    a, b, c = (dataclasses.replace(built, question=words[:n]) for n in (20, 25, 40))
    answer(model, "snapkv", 0.5, a, 4)
    first = generate_from_cache._cache_size()  # (other tests may have compiled this one)
    answer(model, "snapkv", 0.5, b, 4)
    answer(model, "snapkv", 0.75, c, 4)
    answer(model, "h2o", 0.5, c, 4)
    assert generate_from_cache._cache_size() == first
    d = dataclasses.replace(built, question=words[:70])  # a 128-token question chunk
    answer(model, "snapkv", 0.5, d, 4)
    assert generate_from_cache._cache_size() == first + 1


@pytest.mark.parametrize("name", ["adakv-h2o", "adakv-expected"])
def test_adakv_samples_of_one_cell_compile_nothing_new(tiny_model, name):
    """A second sample of a cell (another context of the same length, the same question)
    compiles nothing, although its heads share the pool differently: no array is sized by
    the shares (before, the pooled append cache was built by eager ops of per-sample shapes,
    compiled again for every sample and layer)."""
    from kvjax.eval._ruler import answer

    model = tiny_model
    a, b = (build_sample(model.tokenizer, "niah_single_1", 300, seed) for seed in (0, 1))
    b = dataclasses.replace(b, question=a.question)
    assert len(a.context) == len(b.context) and a.context != b.context
    answer(model, name, 0.5, a, 4)
    # (lowerings count also programs the persistent compilation cache then loads)
    assert count_events(LOWERING, lambda: answer(model, name, 0.5, b, 4)) == 0
