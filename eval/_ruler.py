"""RULER-style evaluation under kvpress's protocol: each sample's context is compressed once to
(1 − ratio) × its length (`press_context`), then the question and answer append; scores by
string_match_all ×100 per (policy, ratio, task, length). Results as JSON rows, a table and a
kvpress-style plot (score vs compression ratio, one line per policy)."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import Cache
from kvjax.generate import GenerateConfig, generate_from_cache
from kvjax.models import Params, stack_params
from kvjax.policies import (
    ADAKV_PREFIX,
    BUDGETLESS,
    NEEDS_LAYERS,
    POLICIES,
    RECONSTRUCT_CONTINUE,
    RECONSTRUCT_PROMPT,
    Policy,
    make_policy,
)
from kvjax.weights import LoadedModel

from ._press import Pressed, is_tiered, press_context
from ._ruler_tasks import _SLOT, TASKS, RulerSample, build_sample, string_match_all


@dataclasses.dataclass(frozen=True, kw_only=True)
class RulerRow:
    """One (policy, ratio, task, length) score over its samples (JSON-ready)."""

    policy: str
    ratio: float
    task: str
    length: int
    score: float
    samples: int
    kept_tokens: float
    seconds_compress: float
    answers: list[str]


def check_ruler_args(
    tasks: Sequence[str], lengths: Sequence[int], ratios: Sequence[float], samples: int
) -> None:
    """Raise ValueError naming the first bad argument."""
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown RULER task {t!r}; choose from {sorted(TASKS)}")
    if not lengths or min(lengths) < 256:
        raise ValueError(f"lengths must be >= 256 tokens, got {list(lengths)}")
    if not ratios or not all(0 <= r < 1 for r in ratios):
        raise ValueError(f"compression ratios must be in [0, 1), got {list(ratios)}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")


@functools.cache
def adakv_presses() -> tuple[str, ...]:
    """The registry names `adakv` can wrap (fixed-budget full-precision ranked policies): those
    it accepts at a budget every press takes."""
    ok = []
    for name in sorted(POLICIES):
        try:
            make_policy("adakv", 4096, press=name, num_layers=2)
        except ValueError:
            continue
        ok.append(name)
    return tuple(ok)


def check_ruler_policies(names: Sequence[str]) -> None:
    """Raise ValueError (one line) for the first name that is neither a registry policy nor
    `adakv-<press>` with a press adakv wraps."""
    for name in names:
        if name.startswith(ADAKV_PREFIX):
            press = name[len(ADAKV_PREFIX) :]
            if press not in adakv_presses():
                raise ValueError(
                    f"policy {name!r}: {press!r} is not a press adakv wraps; choose one of "
                    f"{list(adakv_presses())}"
                )
        elif name not in POLICIES:
            raise ValueError(
                f"unknown policy {name!r}; choose one of {sorted(POLICIES)} or adakv-<press> "
                f"with a press from {list(adakv_presses())}"
            )
        elif name != "full":
            _check_pressable(name)


def _check_pressable(name: str) -> None:
    """Raise ValueError (one line) before any sample runs if `name` cannot compress once:
    a policy that takes no budget (no ratio applies) or a tiered one (the press keeps
    full-precision tokens: compare those under the bounded protocol, `kvjax niah`)."""
    if name in BUDGETLESS:
        raise ValueError(f"policy {name!r} takes no budget: no compression ratio applies")
    spec = _registry_policy(name, 4096, 2).cache_spec(
        batch=1, num_layers=2, num_kv_heads=1, head_dim=64, max_len=8192, dtype=jnp.float32
    )
    if is_tiered(spec):
        raise ValueError(
            f"policy {name!r} is tiered (INT8/low-bit) and the compress-once press keeps "
            "full-precision tokens; compare it under the bounded protocol (kvjax niah)"
        )


def ruler_policy(name: str, budget: int, num_layers: int) -> Policy:
    """The policy a `kvjax ruler` name stands for at `budget`: a registry name, or
    `adakv-<press>` (adakv over `press`, each with its defaults)."""
    check_ruler_policies([name])
    if name.startswith(ADAKV_PREFIX):
        return make_policy("adakv", budget, press=name[len(ADAKV_PREFIX) :], num_layers=num_layers)
    return _registry_policy(name, budget, num_layers)


def _registry_policy(name: str, budget: int, num_layers: int) -> Policy:
    kw = {"num_layers": num_layers} if name in NEEDS_LAYERS else {}
    return make_policy(name, budget, **kw)


def kvzip_ids(model: LoadedModel) -> dict[str, list[int]]:
    """KVzip's reconstruction prompts and the chat's assistant head, tokenized."""
    tok = model.tokenizer
    tail = tok.apply_chat_template([{"role": "user", "content": _SLOT}]).split(_SLOT)[1]
    return dict(
        reconstruct=tok.encode(RECONSTRUCT_PROMPT),
        reconstruct_next=tok.encode(RECONSTRUCT_CONTINUE),
        suffix=tok.encode(tail),
    )


def answer_room(question: int, max_new_tokens: int) -> int:
    """Free slots after the kept context: the question, the answer and one more, rounded up to
    a multiple of 16 so that samples whose questions differ by a few tokens share one compiled
    generate step (empty slots are never attended)."""
    return _round_up(question + max_new_tokens + 1, 16)


# Shapes of a grid's cells rounded up to multiples of this: the append-only cache holds
# context + room slots rounded up at every ratio (its free slots are never attended), the
# prefill pads the context to a multiple of it, so the cells of one length share their
# compiled steps.
PRESS_BUCKET = 256


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def answer(
    model: LoadedModel,
    policy_name: str,
    ratio: float,
    sample: RulerSample,
    max_new_tokens: int,
    scan_params: Params | None = None,
) -> tuple[str, int, float]:
    """(answer text, tokens kept per KV head (layer mean), compression seconds); `scan_params`:
    the model's params stacked once for many calls (`press_context`)."""
    cfg = model.config
    s = len(sample.context)
    if policy_name in BUDGETLESS or ratio == 0:
        policy = make_policy("full")
    else:
        # A budget N caches N - 1 tokens (it counts the attended current token): N - 1 =
        # int((1 - ratio) * s), the tokens kvpress keeps.
        policy = ruler_policy(policy_name, max(2, int(s * (1 - ratio)) + 1), cfg.num_layers)
    gen = GenerateConfig(max_new_tokens=max_new_tokens)
    ids, _, pressed = answer_pressed(
        model, policy, sample.context, sample.question, gen, question_multiple=64,
        scan_params=scan_params,
    )  # fmt: skip
    text = model.tokenizer.decode(ids, skip_special=True)
    return text, float(np.mean(pressed.kept)), pressed.seconds


def answer_pressed(
    model: LoadedModel,
    policy: Policy,
    context: Sequence[int],
    question: Sequence[int],
    gen: GenerateConfig,
    *,
    question_multiple: int,
    scan_params: Params | None = None,
    dtype=jnp.float32,
) -> tuple[list[int], Cache, Pressed]:
    """kvpress's protocol for one prompt: `context` compressed once by `policy`
    (`press_context`, with KVzip's reconstruction prompts when it or adakv's press is kvzip),
    then `question` and the answer (`gen`; its chunk the question rounded up to
    `question_multiple`) in the append-only cache. Shapes are bucketed (`PRESS_BUCKET`) so
    prompts of one length share their compiled steps. Returns the answer ids, the final cache
    and the compressed context."""
    s = len(context)
    room = answer_room(len(question), gen.max_new_tokens)
    pressed = press_context(
        model.config,
        model.params,
        policy,
        context,
        room=room,
        dtype=dtype,
        min_slots=_round_up(s + room, PRESS_BUCKET),
        chunk_multiple=PRESS_BUCKET,
        scan_params=scan_params,
        **(kvzip_ids(model) if getattr(policy, "press", policy).name == "kvzip" else {}),
    )
    chunk = _round_up(len(question), question_multiple)
    ids = jnp.asarray(question, jnp.int32)
    q = jnp.zeros((1, chunk), jnp.int32).at[0, : len(question)].set(ids)
    res, cache = generate_from_cache(
        model.config,
        pressed.policy,
        dataclasses.replace(gen, chunk_size=chunk),
        model.params,
        pressed.cache,
        q,
        jnp.asarray([len(question)]),
        jax.random.key(0),
    )
    return np.asarray(res.tokens)[0, : int(res.num_generated[0])].tolist(), cache, pressed


def run_ruler(
    model: LoadedModel,
    policies: Sequence[str],
    *,
    tasks: Sequence[str],
    lengths: Sequence[int],
    ratios: Sequence[float],
    samples: int = 4,
    seed: int = 0,
    max_new_tokens: int = 32,
    on_sample: Callable[[str], None] | None = None,
    on_row: Callable[[list[RulerRow]], None] | None = None,
) -> list[RulerRow]:
    """Every policy × ratio × task × length, `samples` seeded prompts each ("full" runs once,
    at ratio 0). A policy is a registry name or `adakv-<press>` (`ruler_policy`). `on_row` gets
    the rows so far after each (task, length, policy, ratio) cell, e.g. to save them as they
    come (the CLI rewrites its JSON, so a run cut short keeps its finished cells)."""
    check_ruler_policies(policies)
    check_ruler_args(tasks, lengths, ratios, samples)
    rows = []
    scan_params = stack_params(model.params, model.config)  # once for every cell's scanned prefill
    for task in tasks:
        for length in lengths:
            prompts = [
                build_sample(model.tokenizer, task, length, seed + i) for i in range(samples)
            ]
            for name in policies:
                for ratio in [0.0] if name == "full" else ratios:
                    got = []
                    for p in prompts:
                        got.append(answer(model, name, ratio, p, max_new_tokens, scan_params))
                        if on_sample is not None:
                            on_sample(f"{task} {length} {name} {ratio:g}")
                    rows.append(
                        RulerRow(
                            policy=name,
                            ratio=ratio,
                            task=task,
                            length=length,
                            score=string_match_all(
                                [g[0] for g in got], [p.answers for p in prompts]
                            ),
                            samples=samples,
                            kept_tokens=float(np.mean([g[1] for g in got])),
                            seconds_compress=float(np.mean([g[2] for g in got])),
                            answers=[g[0] for g in got],
                        )
                    )
                    if on_row is not None:
                        on_row(list(rows))
    return rows


def ruler_summary(rows: Sequence[RulerRow]) -> list[dict]:
    """The table: per (policy, ratio) the mean score over tasks and lengths, and per task."""
    out = []
    for key in dict.fromkeys((r.policy, r.ratio) for r in rows):
        mine = [r for r in rows if (r.policy, r.ratio) == key]
        mean = round(float(np.mean([r.score for r in mine])), 1)
        row = {"policy": key[0], "ratio": key[1], "score": mean}
        for task in dict.fromkeys(r.task for r in mine):
            row[task] = round(float(np.mean([r.score for r in mine if r.task == task])), 1)
        out.append(row)
    return out


def write_ruler_json(rows: Sequence[RulerRow], out_dir: str, meta: dict) -> str:
    """ruler.json: meta + rows, the whole file rewritten on every call."""
    d = pathlib.Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    j = d / "ruler.json"
    j.write_text(json.dumps({**meta, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
    return str(j)


def write_ruler_outputs(rows: Sequence[RulerRow], out_dir: str, meta: dict) -> tuple[str, str]:
    """ruler.json (meta + rows) and ruler.png (score vs compression ratio per policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    j = write_ruler_json(rows, out_dir, meta)
    png = pathlib.Path(out_dir) / "ruler.png"
    summary = ruler_summary(rows)
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    full = [s["score"] for s in summary if s["policy"] == "full"]
    names = list(dict.fromkeys(s["policy"] for s in summary if s["policy"] != "full"))
    markers = "osD^vP*X<>hp"
    for i, name in enumerate(names):  # 20 colours x 12 markers: no two lines look alike
        pts = sorted((s["ratio"], s["score"]) for s in summary if s["policy"] == name)
        if full and pts[0][0] > 0:  # as kvpress plots: every line starts at the full cache
            pts.insert(0, (0.0, full[0]))
        style = dict(color=plt.cm.tab20(i % 20), marker=markers[i % len(markers)])
        ax.plot(*zip(*pts, strict=True), label=name, **style)
    if full:
        ax.axhline(full[0], color="black", ls="--", lw=1, label="full cache")
    ax.set_xlabel("compression ratio")
    ax.set_ylabel("RULER score (string_match_all ×100)")
    ax.set_title(f"{meta.get('model', '')} — RULER {meta.get('lengths', '')}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside, not over, lines
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return str(j), str(png)
