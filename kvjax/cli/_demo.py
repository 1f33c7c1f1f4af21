"""`kvjax demo`: the main job of the README. Generates from a chat prompt and from a long essay
prompt with the full, window and streaming policies and compares them in one table."""

from __future__ import annotations

import argparse
import json
import pathlib

from kvjax.cli._common import DTYPES, emit
from kvjax.cli._generate import generate_text
from kvjax.generate import GenerateConfig
from kvjax.policies import make_policy

CHAT_PROMPT = "What is the capital of France? Answer in one sentence."


def register(sub) -> None:
    p = sub.add_parser("demo", help="generate with full/window/streaming and compare")
    p.add_argument("--model", default=None, help="GGUF or HF folder (default: embedded)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--budget", type=int, default=256, help="window/streaming budget")
    p.add_argument("--essay-tokens", type=int, default=1536, help="long prompt length")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="also write JSON here")
    p.set_defaults(func=run)


def agreement(ids: list[int], ref: list[int]) -> tuple[float, int]:
    """(fraction of positions equal to the reference, index of the first difference or -1)."""
    n = max(len(ids), len(ref))
    same = [i < len(ids) and i < len(ref) and ids[i] == ref[i] for i in range(n)]
    first = same.index(False) if False in same else -1
    return sum(same) / max(n, 1), first


def run(args: argparse.Namespace) -> int:
    from kvjax.eval import essay_tokens
    from kvjax.weights import load_model

    model = load_model(args.model, dtype=DTYPES[args.dtype])
    tok = model.tokenizer
    if tok is None:
        raise SystemExit(f"error: model {model.source} has no tokenizer")
    prompts = {
        "chat": tok.encode(tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}])),
        "essay": essay_tokens(model, args.essay_tokens).tolist(),
    }
    policies = [
        make_policy("full"),
        make_policy("window", args.budget),
        make_policy("streaming", args.budget),
    ]
    gen = GenerateConfig(
        max_new_tokens=args.max_new_tokens, stop_tokens=tok.eos_ids, cache_dtype=args.dtype
    )
    rows = []
    for pname, ids in prompts.items():
        ref = None
        for policy in policies:
            if not args.json:
                print(f"[{pname}] {policy.name}: compiling and generating …", flush=True)
            generate_text(model, ids, policy, gen)  # first call compiles
            new, seconds, live = generate_text(model, ids, policy, gen)
            ref = new if ref is None else ref
            agree, first = agreement(new, ref)
            rows.append(
                {
                    "prompt": pname,
                    "policy": policy.name,
                    "budget": None if policy.name == "full" else args.budget,
                    "prompt_tokens": len(ids),
                    "new_tokens": len(new),
                    "tokens_per_s": len(new) / seconds,
                    "live_kv_KiB": round(live / 1024, 1),
                    "agree_with_full": round(agree, 3),
                    "first_diff": first,
                    "text": tok.decode(new, skip_special=True).replace("\n", " ")[:70],
                }
            )
    title = f"kvjax demo — {model.config.name or model.source}"
    if args.json:
        emit(rows, as_json=True, title=title, out=args.out)
        return 0
    if args.out:  # the file gets the JSON rows either way
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    emit(demo_table(rows), as_json=False, title=title)
    for r in rows:
        print(f"{r['prompt']:>5} {r['policy']:>9}: {r['text']}")
    return 0


def demo_table(rows: list[dict]) -> list[dict[str, str]]:
    """The demo's rows as short text cells: 80 columns (a pipe, not a terminal) hold them whole;
    the generated texts are printed below the table, one line each."""
    return [
        {
            "prompt": r["prompt"],
            "policy": r["policy"],
            "budget": "-" if r["budget"] is None else str(r["budget"]),
            "in/new": f"{r['prompt_tokens']}/{r['new_tokens']}",
            "tok/s": f"{r['tokens_per_s']:.2f}",
            "live MiB": f"{r['live_kv_KiB'] / 1024:.2f}",
            "agree": f"{r['agree_with_full']:.3f}",
            "diff at": "-" if r["first_diff"] < 0 else str(r["first_diff"]),
        }
        for r in rows
    ]
