"""RULER-style synthetic tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"), generated offline and seeded, in token space for one tokenizer.

Tasks as RULER's synthetic.yaml defines them: needle "One of the special magic {type} for {key}
is: {value}.", keys adjective-noun words or UUIDs, values 7-digit numbers or UUIDs; haystacks of
the Paul Graham essays ("essay"), a repeated noise paragraph ("noise") or other needles
("needle"); vt (a chain of 4 hops of variable assignments in noise), cwe (10 words × 30 among
words × 3 in a numbered list), fwe (coded words drawn from a Zipf law of α = 2, the top 3 asked).
A sample's prompt (chat head, task text, context and question, chat tail, answer prefix) is
`length` tokens: haystacks are cut in token space; cwe/fwe fit their item count by bisection.
Scoring: RULER's string_match_all (the share of reference strings found in the answer, ×100).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import uuid
from collections.abc import Sequence

import numpy as np

from kvjax.eval._niah_prompt import haystack_text, insert_needle
from kvjax.weights import Tokenizer

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type} for {key} is: {value}."
_SLOT = "@@RULER_CONTEXT@@"


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_ADJ = _words(
    "able acid aged airy bald best bold brave busy calm cheap chief clean cold cool crisp cute "
    "damp dark dear deep dry dull eager early easy even fair fancy fast fine firm flat fond "
    "free fresh full glad gold grand gray great green grim happy hard harsh huge icy idle jolly "
    "keen kind large late lazy lean light live lone loud lucky mad mild moist narrow neat new "
    "noble odd old pale plain polite proud quick quiet rapid rare raw rich ripe rough round "
    "royal rude sad safe salty sharp shy silly slow small smart soft solid sour spare stark "
    "steep stiff sweet swift tall tame tidy tiny tough vast warm weak wet white wide wild wise "
    "witty young"
)
_NOUN = _words(
    "acorn anchor apple arrow badge basket beach bell bike blanket boat bottle bridge brush "
    "bucket cabin camera candle canoe castle cellar chair cherry circle clock cloud coat comet "
    "copper cotton crayon crown desk diamond dinner dragon drum eagle engine falcon feather "
    "fence field flag forest fork fountain garden gate glove guitar hammer harbor helmet honey "
    "island jacket jungle kettle kitten ladder lamp lantern lemon library magnet maple marble "
    "meadow mirror monkey needle ocean orange orchard oven paddle palace parrot pebble pencil "
    "piano pillow planet pocket puzzle quilt rabbit river rocket saddle sandal scarf shadow "
    "shovel silver spoon statue stove sunset table teapot ticket tiger tower trumpet tunnel "
    "valley velvet wagon wallet window winter wizard"
)
TASKS = {  # name -> (haystack, key type, value type, keys, values per key, queried keys)
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4),
    "vt": None,
    "cwe": None,
    "fwe": None,
}
NIAH_TEXT = (
    "Some special magic {type} are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the {type} afterwards.\n{context}\nWhat are all the special "
    "magic {type} for {query} mentioned in the provided text?",
    " The special magic {type} for {query} mentioned in the provided text are",
)
VT_TEXT = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text "
    "above.",
    " Answer: According to the chain(s) of variable assignment in the text above, 5 variables "
    "are assgined the value {query}, they are: ",
)
CWE_TEXT = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most "
    "common words in the above list?",
    " Answer: The top 10 words that appear most often in the list are:",
)
FWE_TEXT = (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words. {context}\nQuestion: Do not provide any "
    "explanation. Please ignore the dots '....'. What are the three most frequently appeared "
    "words in the above coded text?",
    " Answer: According to the coded text above, the three most frequently appeared words are:",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RulerSample:
    """One prompt in token space.

    Attributes:
        task, length: the task and the target prompt length (tokens).
        context: chat head ‖ task text ‖ context (what a query-agnostic press compresses).
        question: question ‖ chat tail ‖ answer prefix.
        answers: the reference strings (string_match_all).
        needles: (start in `context`, token ids) of each inserted needle / statement.
    """

    task: str
    length: int
    context: list[int]
    question: list[int]
    answers: list[str]
    needles: list[tuple[int, list[int]]]


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's score: mean over samples of the share of references found (case-insensitive)
    in the prediction, × 100."""
    if len(preds) != len(refs) or not preds:
        raise ValueError(f"{len(preds)} predictions for {len(refs)} reference lists")
    pairs = zip(preds, refs, strict=True)
    hit = [sum(r.lower() in p.lower() for r in rs) / len(rs) for p, rs in pairs]
    return 100.0 * float(np.mean(hit))


def build_sample(tok: Tokenizer, task: str, length: int, seed: int) -> RulerSample:
    """The `seed`-th sample of `task` at `length` prompt tokens.

    Raises:
        ValueError: unknown task, or a length too short for the task's fixed text.
    """
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {sorted(TASKS)}")
    return _build(tok, task, length, seed, length - question_reserve(tok, task, length))


@functools.cache
def question_reserve(tok: Tokenizer, task: str, length: int) -> int:
    """Tokens left for the question part: the median over 8 probe samples (seeds 10⁶…) of the
    question part of a prompt fitted to exactly `length`. Every sample of (task, length) then
    has a context of exactly length − reserve tokens (one compiled press per policy, budget and
    cell), its prompt within a few tokens of `length`."""
    probes = [len(_build(tok, task, length, 10**6 + i, None).question) for i in range(8)]
    return int(np.median(probes))


def _build(tok, task, length, seed, context_len) -> RulerSample:
    """A sample whose context is `context_len` tokens (None: whatever makes the prompt exactly
    `length`)."""
    rng = np.random.default_rng([seed, length, sorted(TASKS).index(task)])
    if task == "vt":
        return _vt(tok, length, rng, context_len)
    if task in ("cwe", "fwe"):
        return _counting(tok, task, length, rng)
    return _niah(tok, task, length, rng, context_len)


def _chat(tok: Tokenizer, text: str, prefix: str, **fmt) -> tuple[list[int], list[int]]:
    head, tail = tok.apply_chat_template(
        [{"role": "user", "content": text.format(context=_SLOT, **fmt)}]
    ).split(_SLOT)
    return tok.encode(head), tok.encode(tail + prefix.format(**fmt))


def _key(kind: str, rng) -> str:
    if kind == "uuids":
        return str(uuid.UUID(bytes=rng.bytes(16), version=4))
    return f"{_ADJ[rng.integers(len(_ADJ))]}-{_NOUN[rng.integers(len(_NOUN))]}"


def _value(kind: str, rng) -> str:
    return _key("uuids", rng) if kind == "uuids" else str(rng.integers(1_000_000, 10_000_000))


@functools.cache
def _haystack(tok: Tokenizer, kind: str) -> tuple[int, ...]:
    text = haystack_text()[:400_000] if kind == "essay" else (NOISE + " ") * 3000
    return tuple(tok.encode(text))


def _assemble(tok, task, length, rng, head, tail, hay, inserts, answers, ctx) -> RulerSample:
    """Cut `hay` so the context is `ctx` tokens (None: the prompt `length`) and splice
    `inserts` (token lists, in order) at random sentence ends, in order of depth."""
    ctx = length - len(tail) if ctx is None else ctx
    n = ctx - len(head) - sum(map(len, inserts))
    if n < 1 or n > len(hay):
        raise ValueError(f"RULER {task}: length {length} cannot fit (haystack {n} tokens)")
    body = list(hay[:n])
    ends = {i for i in set(body) if tok.decode([i]).rstrip().endswith(".")}
    spots = [
        insert_needle(body, [], d, ends.__contains__)[1]
        for d in np.sort(rng.uniform(0, 100, len(inserts)))
    ]
    out, spans, prev = list(head), [], 0
    for at, ins in zip(spots, inserts, strict=True):
        out += body[prev:at]
        spans.append((len(out), ins))
        out += ins
        prev = at
    out += body[prev:]
    return RulerSample(
        task=task, length=length, context=out, question=tail, answers=answers, needles=spans
    )


def _niah(tok, task, length, rng, ctx) -> RulerSample:
    hay_kind, k_kind, v_kind, n_keys, n_values, n_query = TASKS[task]
    keys: list[str] = []
    while len(keys) < n_keys + (40 if hay_kind == "needle" else 0):
        if (k := _key(k_kind, rng)) not in keys:
            keys.append(k)
    values = [[_value(v_kind, rng) for _ in range(n_values)] for _ in range(n_keys)]
    needles = [
        NEEDLE.format(type=v_kind, key=k, value=v)
        for k, vs in zip(keys, values, strict=False)
        for v in vs
    ]
    order = rng.permutation(len(needles))
    inserts = [tok.encode(" " + needles[i]) for i in order]
    queried = keys[:n_query]
    query = queried[0] if n_query == 1 else ", ".join(queried[:-1]) + ", and " + queried[-1]
    head, tail = _chat(tok, *NIAH_TEXT, type=v_kind, query=query)
    if hay_kind == "needle":  # distractor needles of other keys, as many as fit
        distract = [
            NEEDLE.format(type=v_kind, key=keys[n_keys + i % 40], value=_value(v_kind, rng))
            for i in range(length // 8)
        ]
        hay = tuple(tok.encode(" " + " ".join(distract)))
    else:
        hay = _haystack(tok, hay_kind)
    answers = [v for vs in values[:n_query] for v in vs]
    return _assemble(tok, task, length, rng, head, tail, hay, inserts, answers, ctx)


def _vt(tok, length, rng, ctx) -> RulerSample:
    names: list[str] = []
    while len(names) < 5:
        if (v := "".join(chr(65 + c) for c in rng.integers(0, 26, 5))) not in names:
            names.append(v)
    value = str(rng.integers(10_000, 100_000))
    hops = zip(names[:-1], names[1:], strict=True)
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in hops]
    head, tail = _chat(tok, *VT_TEXT, query=value)
    inserts = [tok.encode(" " + s) for s in chain]
    hay = _haystack(tok, "noise")
    return _assemble(tok, "vt", length, rng, head, tail, hay, inserts, names, ctx)


@functools.cache
def _essay_words() -> tuple[str, ...]:
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,10}\b", haystack_text()[:400_000]))))


def _counting(tok, task, length, rng) -> RulerSample:
    text, prefix = CWE_TEXT if task == "cwe" else FWE_TEXT
    head, tail = _chat(tok, text, prefix)
    room = length - len(head) - len(tail)
    if task == "cwe":
        pool = list(_essay_words())
    else:
        pool = ["".join(chr(97 + c) for c in rng.integers(0, 26, 5)) for _ in range(2000)]
    pool = [pool[i] for i in rng.permutation(len(pool))]
    ranks = np.minimum(rng.zipf(2.0, max(1, room)), len(pool)) - 1  # fwe: one draw, cut below
    shuffle = rng.permutation(10 * max(1, room))

    def make(m: int) -> tuple[list[str], list[str]]:
        if task == "cwe":  # 10 common words × f (30, less if they would fill the list), rest × 3
            freq = max(4, min(30, room // 80))
            items = [w for w in pool[:10] for _ in range(freq)]
            items += [w for w in pool[10:] for _ in range(3)][: max(0, m - len(items))]
            return [items[i] for i in shuffle if i < len(items)], pool[:10]
        return [pool[r] for r in ranks[:m]], []

    def render(items):
        if task == "cwe":
            return " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        return " " + " .... ".join(items)

    lo, hi = 1, max(2, room)  # the most items whose rendering fits in `room` tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(tok.encode(render(make(mid)[0]))) <= room else (lo, mid - 1)
    items, answers = make(lo)
    body = tok.encode(render(items))
    pad = tok.encode("\n")
    if len(pad) == 1:  # every sample's context the same length (one press compile per cell)
        body += pad * max(0, room - len(body))
    if len(body) > room or room - len(body) > 0.01 * length:
        raise ValueError(f"RULER {task}: length {length} cannot fit ({len(body)} of {room})")
    if task == "fwe":
        counts = sorted(((items.count(w), w) for w in set(items)), reverse=True)
        answers = [w for _, w in counts[:3]]
    return RulerSample(
        task=task, length=length, context=[*head, *body], question=tail, answers=answers, needles=[]
    )
