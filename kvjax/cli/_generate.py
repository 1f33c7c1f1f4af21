"""`kvjax generate`: text in, text out, through a policy's cache."""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvjax.cli._common import (
    add_model_args,
    add_policy_args,
    add_scan_arg,
    build_policy,
    check_scan,
    emit,
    load,
    say,
)
from kvjax.generate import GenerateConfig, Sampling, generate


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_policy_args(p)
    add_model_args(p)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=256, help="prefill chunk (tokens)")
    add_scan_arg(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--trace",
        default=None,
        metavar="PNG",
        help="plot live KV bytes per tier, confidence and budget per step",
    )
    p.set_defaults(func=run)


def generate_text(
    model,
    prompt_ids: list[int],
    policy,
    gen: GenerateConfig,
    seed: int = 0,
    trace: str | None = None,
):
    """Generate once; returns (ids, seconds, live bytes at the end); optionally plots a trace."""
    t = time.perf_counter()
    out = generate(model.config, model.params, [prompt_ids], policy=policy, gen=gen, seed=seed)
    n = int(out.num_generated[0])
    ids = np.asarray(out.tokens[0, :n]).tolist()
    seconds = time.perf_counter() - t
    if trace:
        from kvjax.eval import plot_trace

        plot_trace(
            out.telemetry,
            trace,
            tau=getattr(policy, "tau", None),
            title=f"{policy.name} — {model.config.name or model.source}",
        )
    return ids, seconds, int(out.telemetry.live_bytes()[max(n - 1, 0), 0])


def run(args: argparse.Namespace) -> int:
    check_scan(build_policy(args.policy, args), args)  # bad flags fail before the model loads
    model = load(args)
    policy = build_policy(args.policy, args, model.config.num_layers)
    check_scan(policy, args)
    tok = model.tokenizer
    if tok is None:
        raise SystemExit(f"error: model {model.source} has no tokenizer; cannot encode text")
    text = (
        tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        if args.chat
        else args.prompt
    )
    ids = tok.encode(text)
    gen = GenerateConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=Sampling(temperature=args.temperature, top_p=args.top_p),
        stop_tokens=tok.eos_ids,
        chunk_size=args.chunk_size,
        cache_dtype=args.dtype,
        scan_layers=args.scan_layers,
    )
    say(f"generating with {policy.name} (the first call compiles: a minute or more on CPU)")
    new, seconds, live = generate_text(model, ids, policy, gen, args.seed, args.trace)
    say(f"{len(new)} tokens in {seconds:.1f} s")
    shown = new[:-1] if new and new[-1] in gen.stop_tokens else new  # never print a stop token
    result = {
        "policy": policy.name,
        "budget": args.budget,
        "prompt_tokens": len(ids),
        "new_tokens": len(new),
        "seconds": seconds,
        "live_kv_bytes": live,
        "new_ids": new,
        "text": tok.decode(shown, skip_special=True),
    }
    if args.json:
        emit(result, as_json=True, title="generate")
    else:
        print(result["text"])
        print(
            f"[{policy.name}] {len(ids)} prompt + {len(new)} new tokens in {seconds:.2f}s "
            f"(incl. compilation); live KV {live / 2**20:.2f} MiB"
        )
    return 0
