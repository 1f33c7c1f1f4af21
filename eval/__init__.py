"""Evaluation: perplexity through the compressed cache, decode benchmarks, needle in a haystack.

Installed as `kvjax.eval`; uses only kvjax's public API.
"""

from kvjax.eval._bench import DecodeBench, bench_decode
from kvjax.eval._bench_kernel import KernelBench, bench_kernel
from kvjax.eval._confkl import (
    ConfKLResult,
    check_confidence_kl_args,
    held_out_essays,
    iter_ablation_logits,
    run_confidence_kl,
    sample_positions,
)
from kvjax.eval._confkl_report import confidence_kl_rows, plot_confidence_kl
from kvjax.eval._diagnostics import (
    FmmStream,
    LirCounts,
    complete_windows,
    future_missed_mass,
    global_lir,
    kept_windows,
    ratio_mean,
    selection_churn,
    window_activity,
    window_of_positions,
    window_sums,
)
from kvjax.eval._diagnostics_pass import ShadowRecord, shadow_pass
from kvjax.eval._diagnostics_report import (
    DiagnosticsSettings,
    PolicyDiagnostics,
    check_diagnostics_args,
    diagnostics_rows,
    plot_diagnostics,
    run_diagnostics,
    summarize,
    text_tokens,
)
from kvjax.eval._niah import (
    NiahCell,
    NiahResult,
    run_niah,
)
from kvjax.eval._niah_plot import (
    niah_summary_rows,
    plot_niah_heatmap,
    read_niah_result,
    write_niah_outputs,
)
from kvjax.eval._niah_prompt import (
    NEEDLE,
    QUESTION,
    SCORING_RULE,
    NiahPrompt,
    NiahProtocol,
    NiahTemplate,
    build_niah_prompt,
    check_niah_grid,
    insert_needle,
    score_niah_answer,
)
from kvjax.eval._ppl import PplResult, essay_tokens, run_ppl
from kvjax.eval._press import Pressed, press_context
from kvjax.eval._ruler import (
    RulerRow,
    adakv_presses,
    check_ruler_args,
    check_ruler_policies,
    ruler_policy,
    ruler_summary,
    run_ruler,
    write_ruler_json,
    write_ruler_outputs,
)
from kvjax.eval._ruler_tasks import TASKS as RULER_TASKS
from kvjax.eval._ruler_tasks import RulerSample, build_sample, string_match_all
from kvjax.eval._stats import bootstrap_ci, kl_divergence, pearson, rankdata, spearman
from kvjax.eval._stream import StreamChunk, plot_stream, run_stream, stream_tokens
from kvjax.eval._trace import plot_trace

__all__ = [
    "NEEDLE",
    "QUESTION",
    "SCORING_RULE",
    "DecodeBench",
    "KernelBench",
    "NiahCell",
    "NiahPrompt",
    "NiahProtocol",
    "NiahResult",
    "NiahTemplate",
    "PplResult",
    "Pressed",
    "press_context",
    "RULER_TASKS",
    "RulerRow",
    "RulerSample",
    "build_sample",
    "adakv_presses",
    "check_ruler_args",
    "check_ruler_policies",
    "ruler_policy",
    "ruler_summary",
    "run_ruler",
    "string_match_all",
    "write_ruler_json",
    "write_ruler_outputs",
    "bench_decode",
    "bench_kernel",
    "build_niah_prompt",
    "check_niah_grid",
    "essay_tokens",
    "insert_needle",
    "niah_summary_rows",
    "plot_niah_heatmap",
    "read_niah_result",
    "run_niah",
    "run_ppl",
    "run_stream",
    "plot_stream",
    "stream_tokens",
    "StreamChunk",
    "plot_trace",
    "score_niah_answer",
    "write_niah_outputs",
    "ConfKLResult",
    "bootstrap_ci",
    "check_confidence_kl_args",
    "confidence_kl_rows",
    "held_out_essays",
    "iter_ablation_logits",
    "kl_divergence",
    "pearson",
    "plot_confidence_kl",
    "rankdata",
    "run_confidence_kl",
    "sample_positions",
    "spearman",
    "DiagnosticsSettings",
    "FmmStream",
    "LirCounts",
    "PolicyDiagnostics",
    "ShadowRecord",
    "check_diagnostics_args",
    "complete_windows",
    "diagnostics_rows",
    "future_missed_mass",
    "global_lir",
    "kept_windows",
    "plot_diagnostics",
    "ratio_mean",
    "run_diagnostics",
    "selection_churn",
    "shadow_pass",
    "summarize",
    "text_tokens",
    "window_activity",
    "window_of_positions",
    "window_sums",
]
