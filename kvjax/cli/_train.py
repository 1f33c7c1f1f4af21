"""`kvjax train-scorer`: train KVpop's learned eviction scorer on the frozen model's attention."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

from kvjax.cli._common import add_model_args, emit, load


def register(sub) -> None:
    p = sub.add_parser(
        "train-scorer",
        help="train the KVpop eviction scorer (targets: the frozen model's future attention)",
    )
    add_model_args(p)
    g = p.add_argument_group("scorer")
    g.add_argument("--scorer", default="mlstm", choices=["mlstm", "mlp"], help="scorer kind")
    g.add_argument(
        "--immediate",
        action="store_true",
        help="ablation: the mLSTM reads a token right away instead of when it leaves the window",
    )
    g.add_argument("--hidden", type=int, default=32, help="readout MLP width")
    g.add_argument("--memory", type=int, default=16, help="mLSTM memory width")
    g = p.add_argument_group("budget and teacher")
    g.add_argument("--sinks", type=int, default=4, help="s: sink tokens never evicted")
    g.add_argument("--window", type=int, default=32, help="w: protected recent window")
    g.add_argument("--k", type=int, default=96, help="long-range slots (budget = s + w + k)")
    g.add_argument("--aggregate", default="max", choices=["max", "mean"], help="query heads")
    g.add_argument("--decay", type=float, default=0.0, help="λ: temporal decay in the teacher")
    g.add_argument("--weighting", default="uniform", choices=["uniform", "margin"], help="ω")
    g = p.add_argument_group("data")
    g.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence")
    g.add_argument("--train-seqs", type=int, default=32, help="training sequences (essays)")
    g.add_argument("--eval-seqs", type=int, default=4, help="held-out sequences")
    g.add_argument("--held-out", type=int, default=8, help="first N essays (sorted) held out")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=200)
    g.add_argument("--batch", type=int, default=4, help="sequences per step")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup", type=int, default=20, help="warmup steps (then cosine)")
    g.add_argument("--weight-decay", type=float, default=1e-4)
    g.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    g.add_argument("--tau", type=float, default=1.0, help="τ of the boundary loss")
    g.add_argument("--eval-every", type=int, default=50, help="held-out evaluation period")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("outputs")
    g.add_argument("--ckpt-dir", default=None, help="orbax checkpoints; resumes from the latest")
    g.add_argument("--ckpt-every", type=int, default=50)
    g.add_argument("--stop-at", type=int, default=None, help="stop after this step (resume later)")
    g.add_argument("--out", default="kvpop_scorer.msgpack", help="the trained scorer file")
    g.add_argument("--log", default=None, help="write the run (history, accuracy) as JSON")
    g.add_argument("--plot", default=None, help="write the loss curve PNG here")
    g.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--evaluate",
        default=None,
        metavar="SCORER",
        help="no training: report the held-out boundary accuracy of this scorer file (or shipped "
        "name: mlstm, mlp) at the budget flags, with the recency and H2O baselines",
    )
    p.add_argument(
        "--rank-decay",
        type=float,
        default=0.0,
        metavar="LAMBDA",
        help="with --evaluate: rank the scorer's tokens by score + LAMBDA·position, as the kvpop "
        "policy does (its decay; 0.005 by default there)",
    )
    p.set_defaults(func=run)


def _configs(args: argparse.Namespace):
    from kvjax.train import LabelSpec, TrainConfig

    for name in ("seq_len", "train_seqs", "eval_seqs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    budget = args.sinks + args.window + args.k
    if budget >= args.seq_len:
        raise ValueError(
            f"the budget sinks + window + k = {budget} must be < --seq-len {args.seq_len}"
        )
    if args.immediate and args.scorer != "mlstm":
        raise ValueError("--immediate is an ablation of the mlstm scorer's delayed read")
    spec = LabelSpec(
        sinks=args.sinks,
        window=args.window,
        k=args.k,
        aggregate=args.aggregate,
        decay=args.decay,
        weighting=args.weighting,
    )
    cfg = TrainConfig(
        scorer=args.scorer,
        hidden=args.hidden,
        memory=args.memory,
        delayed=not args.immediate,
        labels=spec,
        tau=args.tau,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        clip=args.clip,
        eval_every=args.eval_every,
        ckpt_every=args.ckpt_every,
        seed=args.seed,
    )
    if args.batch > args.train_seqs:
        raise ValueError(f"--batch {args.batch} exceeds --train-seqs {args.train_seqs}")
    return spec, cfg


def run(args: argparse.Namespace) -> int:
    from kvjax.scorers import load_scorer, save_scorer
    from kvjax.train import (
        boundary_accuracy,
        build_teacher_data,
        plot_loss_curve,
        split_essays,
        token_windows,
        train_scorer,
        write_json,
    )

    spec, cfg = _configs(args)  # bad flags fail before the model loads
    model = load(args)
    if model.tokenizer is None:
        raise ValueError(f"model {model.source} has no tokenizer; cannot read the essays")
    split = split_essays(held_out=args.held_out)
    windows = dict(seq_len=args.seq_len)
    eval_tokens = token_windows(model.tokenizer, split.held_out, **windows, limit=args.eval_seqs)
    show = True  # progress bars go to stderr, also under --json
    accuracy = lambda sc, params: dataclasses.asdict(
        boundary_accuracy(
            model.config,
            model.params,
            sc,
            params,
            eval_tokens,
            spec,
            rank_decay=args.rank_decay,
            progress=show,
        )
    )
    if args.evaluate:
        sc, params, _ = load_scorer(args.evaluate)
        row = {"scorer_file": str(args.evaluate), "held_out_sequences": len(eval_tokens)}
        row |= {"rank_decay": args.rank_decay}
        row |= accuracy(sc, params)
        if args.log:
            write_json(args.log, row | {"labels": cfg.to_json()["labels"]})
        emit(row, as_json=args.json, title="held-out boundary accuracy")
        return 0
    train_tokens = token_windows(model.tokenizer, split.train, **windows, limit=args.train_seqs)
    teach = lambda toks: build_teacher_data(model.config, model.params, toks, spec, progress=show)
    train, held = teach(train_tokens), teach(eval_tokens)
    res = train_scorer(
        cfg, model.config, train, held, ckpt_dir=args.ckpt_dir, stop_at=args.stop_at, progress=show
    )
    done = res.history[-1]["step"] if res.history else 0
    record = {
        "model": model.config.name,
        "config": cfg.to_json(),
        "train_essays": list(split.train),
        "held_out_essays": list(split.held_out),
        "train_sequences": len(train),
        "held_out_sequences": len(held),
        "steps_done": done,
        "history": res.history,
        "evals": res.evals,
    }
    if done == cfg.steps:
        meta = {k: record[k] for k in ("model", "config", "held_out_essays", "steps_done")}
        save_scorer(args.out, res.scorer_config, res.params, meta)
        # Report the accuracy of what the file holds (float16 parameters); float16 → float32 →
        # float16 is exact, so writing the reloaded parameters again changes nothing.
        sc, stored, _ = load_scorer(args.out)
        record["boundary_accuracy"] = accuracy(sc, stored)
        save_scorer(args.out, sc, stored, meta | {"accuracy": record["boundary_accuracy"]})
        record["scorer_file"] = str(pathlib.Path(args.out))
    if args.log:
        write_json(args.log, record)
    if args.plot and res.history:
        plot_loss_curve(res.history, res.evals, args.plot, title=f"KVpop {cfg.scorer} scorer")
    summary = {
        "scorer": str(cfg.scorer) + ("" if cfg.delayed else " (immediate)"),
        "steps": done,
        "final_loss": res.history[-1]["loss"] if res.history else float("nan"),
        **{
            f"held_out_{k}": v
            for k, v in (res.evals[-1] if res.evals else {}).items()
            if k != "step"
        },
        **{f"acc_{k}": v for k, v in record.get("boundary_accuracy", {}).items()},
    }
    emit(summary, as_json=args.json, title="train-scorer")
    if not args.json:
        for path in (record.get("scorer_file"), args.log, args.plot):
            if path:
                print(f"wrote {path}")
    return 0
