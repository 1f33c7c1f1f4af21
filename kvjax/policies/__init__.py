"""Cache policies: which tokens stay, where, and at what precision."""

from kvjax.policies._adakv import AdaKVPolicy, adakv_keep
from kvjax.policies._append import AppendPolicy
from kvjax.policies._base import Policy, PositionalPolicy, cached_tokens
from kvjax.policies._chunkkv import ChunkKVPolicy
from kvjax.policies._confidence import Confidence, confidence
from kvjax.policies._confkv import ConfKVPolicy
from kvjax.policies._expected import ExpectedAttentionPolicy, expected_attention_scores, unrotate
from kvjax.policies._full import FullPolicy
from kvjax.policies._h2o import H2OPolicy
from kvjax.policies._keydiff import KeyDiffPolicy
from kvjax.policies._kivi import KIVIPolicy
from kvjax.policies._knorm import KnormPolicy
from kvjax.policies._kvpop import KVpopPolicy
from kvjax.policies._kvzip import (
    RECONSTRUCT_CONTINUE,
    RECONSTRUCT_PROMPT,
    KVzipPolicy,
    kvzip_scores,
)
from kvjax.policies._pressscored import PressScoredPolicy
from kvjax.policies._pyramidkv import PyramidKVPolicy
from kvjax.policies._qevict import QEvictPolicy
from kvjax.policies._random import RandomPolicy
from kvjax.policies._ranked import RankedPolicy
from kvjax.policies._registry import (
    ADAKV_PREFIX,
    BUDGETLESS,
    NEEDS_LAYERS,
    POLICIES,
    make_policy,
)
from kvjax.policies._snapkv import SnapKVPolicy
from kvjax.policies._streaming import StreamingPolicy
from kvjax.policies._tova import TOVAPolicy
from kvjax.policies._window import WindowPolicy

# Short names, as in `lm.chat(..., policy=kvjax.policies.QEvict(budget=512))`: the same classes.
AdaKV = AdaKVPolicy
ChunkKV = ChunkKVPolicy
ConfKV = ConfKVPolicy
ExpectedAttention = ExpectedAttentionPolicy
Full = FullPolicy
H2O = H2OPolicy
KIVI = KIVIPolicy
KeyDiff = KeyDiffPolicy
Knorm = KnormPolicy
KVpop = KVpopPolicy
KVzip = KVzipPolicy
PyramidKV = PyramidKVPolicy
QEvict = QEvictPolicy
Random = RandomPolicy
SnapKV = SnapKVPolicy
Streaming = StreamingPolicy
TOVA = TOVAPolicy
Window = WindowPolicy

__all__ = [
    "ADAKV_PREFIX",
    "AdaKV",
    "ChunkKV",
    "ConfKV",
    "ExpectedAttention",
    "Full",
    "H2O",
    "KIVI",
    "KeyDiff",
    "Knorm",
    "KVpop",
    "KVzip",
    "PyramidKV",
    "QEvict",
    "Random",
    "SnapKV",
    "Streaming",
    "TOVA",
    "Window",
    "AdaKVPolicy",
    "AppendPolicy",
    "BUDGETLESS",
    "ChunkKVPolicy",
    "NEEDS_LAYERS",
    "POLICIES",
    "RECONSTRUCT_CONTINUE",
    "RECONSTRUCT_PROMPT",
    "ConfKVPolicy",
    "Confidence",
    "ExpectedAttentionPolicy",
    "FullPolicy",
    "H2OPolicy",
    "KIVIPolicy",
    "KeyDiffPolicy",
    "KnormPolicy",
    "KVpopPolicy",
    "KVzipPolicy",
    "Policy",
    "PositionalPolicy",
    "PressScoredPolicy",
    "PyramidKVPolicy",
    "QEvictPolicy",
    "RandomPolicy",
    "RankedPolicy",
    "SnapKVPolicy",
    "StreamingPolicy",
    "TOVAPolicy",
    "WindowPolicy",
    "adakv_keep",
    "cached_tokens",
    "confidence",
    "expected_attention_scores",
    "kvzip_scores",
    "make_policy",
    "unrotate",
]
