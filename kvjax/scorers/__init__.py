"""KVpop's learned eviction scorers: Flax modules (trained by `kvjax.train`) and the pure per-layer
math the `kvpop` cache policy runs inside the generate loop."""

from kvjax.scorers._io import DEFAULT_SCORER, SHIPPED, load_scorer, resolve_scorer, save_scorer
from kvjax.scorers._modules import (
    MlpScorer,
    MlstmScorer,
    MlstmState,
    Params,
    ScorerConfig,
    ScorerKind,
    features,
    init_mlstm_state,
    init_scorer_params,
    layer_params,
    make_scorer,
    mlp_score,
    mlstm_scan,
    mlstm_step,
    readout,
)

__all__ = [
    "DEFAULT_SCORER",
    "SHIPPED",
    "MlpScorer",
    "MlstmScorer",
    "MlstmState",
    "Params",
    "ScorerConfig",
    "ScorerKind",
    "features",
    "init_mlstm_state",
    "init_scorer_params",
    "layer_params",
    "load_scorer",
    "make_scorer",
    "mlp_score",
    "mlstm_scan",
    "mlstm_step",
    "readout",
    "resolve_scorer",
    "save_scorer",
]
