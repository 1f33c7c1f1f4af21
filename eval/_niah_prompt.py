"""NIAH prompts and scoring (gkamradt protocol) over Paul Graham's essays; host side only.

Haystack: the essays concatenated in sorted file order and tokenized, cut to `length − buffer −
needle` tokens; the needle (" " + NEEDLE, tokenized on its own) is spliced in at the last sentence
end (a token whose text ends in '.') at or before ⌊n·depth/100⌋ of the n haystack tokens (depth 0:
the start, 100: the end). The prompt is built in token space — chat-template head ‖ haystack with
needle ‖ question and template tail — so the haystack and needle tokens are exactly those counted.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
from collections.abc import Callable, Sequence

from kvjax.weights import Tokenizer, essay_names, essay_text

NEEDLE = (
    "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a "
    "sunny day."
)
QUESTION = "What is the best thing to do in San Francisco?"
KEY_PHRASES = ("sandwich", "dolores park")
# The needle's content words that the question does not already contain (so echoing the question
# earns nothing): the soft score is the fraction of these found as whole words in the answer.
SOFT_WORDS = ("eat", "sandwich", "sit", "dolores", "park", "sunny", "day")
SCORING_RULE = (
    "score = 1 if the answer (lower-cased, whitespace runs collapsed to one space) contains both "
    "'sandwich' and 'dolores park' as substrings, else 0; soft_score = fraction of the words "
    f"{list(SOFT_WORDS)} present among the answer's lower-cased [a-z]+ words"
)
BUFFER = 200
_SLOT = "@@NIAH_CONTEXT@@"


class NiahProtocol(enum.StrEnum):
    """When the question reaches the cache."""

    QUERY_AWARE = "query-aware"  # context + question stream in together
    QUERY_AGNOSTIC = "query-agnostic"  # context compressed first, question appended after
    # kvpress's: the context compressed once, then question and answer append without evicting
    PRESS = "press"


@dataclasses.dataclass(frozen=True, kw_only=True)
class NiahTemplate:
    """How the haystack and question become a chat prompt.

    Attributes:
        user: the user turn; must contain "{context}" before "{question}".
        system: a system turn, or None for the chat template's default.
        answer_prefix: text that starts the assistant turn (part of the prompt, not scored).
    """

    user: str = "{context}\n\n{question} Answer using the text above."
    system: str | None = None
    answer_prefix: str = ""

    def __post_init__(self) -> None:
        c, q = self.user.find("{context}"), self.user.find("{question}")
        if c < 0 or q < c:
            raise ValueError(
                f"NiahTemplate.user must contain '{{context}}' before "
                f"'{{question}}', got {self.user!r}"
            )


DEFAULT_TEMPLATE = NiahTemplate()


@dataclasses.dataclass(frozen=True, kw_only=True)
class NiahPrompt:
    """One grid cell's prompt in token space.

    Attributes:
        context: chat head ‖ haystack with the needle (what query-agnostic compresses alone).
        question: question ‖ chat tail ‖ answer prefix.
        needle_start: index of the needle's first token in `context`.
        needle_depth: where the needle landed, in % of the haystack tokens.
    """

    context: list[int]
    question: list[int]
    needle_start: int
    needle_depth: float


def score_niah_answer(answer: str) -> tuple[float, float]:
    """(score, soft_score) of an answer; see SCORING_RULE."""
    text = " ".join(answer.lower().split())
    score = float(all(p in text for p in KEY_PHRASES))
    words = set(re.findall(r"[a-z]+", text))
    return score, sum(w in words for w in SOFT_WORDS) / len(SOFT_WORDS)


@functools.cache
def haystack_text() -> str:
    """All essays concatenated in sorted file-name order."""
    return "".join(essay_text(n) for n in essay_names())


def check_niah_grid(lengths: Sequence[int], depths: Sequence[float]) -> None:
    """Raise ValueError for an empty grid, a repeated value, a length <= BUFFER, or a depth
    outside [0, 100]."""
    if not lengths or not depths:
        raise ValueError("give at least one context length and one depth")
    if len(set(lengths)) < len(lengths) or len(set(depths)) < len(depths):
        raise ValueError(f"repeated context length or depth in {list(lengths)} × {list(depths)}")
    for n in lengths:
        if n <= BUFFER:
            raise ValueError(
                f"context length {n} is too small: it must exceed the "
                f"{BUFFER}-token buffer kept for the template, question and answer"
            )
    for d in depths:
        if not 0 <= d <= 100:
            raise ValueError(f"depth {d} is outside [0, 100] (percent of the haystack)")


def insert_needle(
    haystack: Sequence[int],
    needle: Sequence[int],
    depth: float,
    is_sentence_end: Callable[[int], bool],
) -> tuple[list[int], int]:
    """Splice `needle` into `haystack` at the last sentence end at or before ⌊n·depth/100⌋.

    Returns the new token list and the needle's start index (0 if no sentence end precedes).
    """
    n = len(haystack)
    at = n if depth >= 100 else n * int(round(depth * 1e6)) // 100_000_000  # exact floor
    if depth < 100:
        while at > 0 and not is_sentence_end(haystack[at - 1]):
            at -= 1
    return [*haystack[:at], *needle, *haystack[at:]], at


def build_niah_prompt(
    tokenizer: Tokenizer,
    haystack: Sequence[int],
    *,
    length: int,
    depth: float,
    template: NiahTemplate = DEFAULT_TEMPLATE,
    buffer: int = BUFFER,
) -> NiahPrompt:
    """The prompt of one cell: `length − buffer` haystack+needle tokens plus the chat parts."""
    messages = [{"role": "user", "content": template.user.format(context=_SLOT, question=QUESTION)}]
    if template.system is not None:
        messages.insert(0, {"role": "system", "content": template.system})
    head, tail = tokenizer.apply_chat_template(messages).split(_SLOT)
    head_ids, tail_ids = tokenizer.encode(head), tokenizer.encode(tail + template.answer_prefix)
    needle = tokenizer.encode(" " + NEEDLE)
    n = length - buffer - len(needle)
    if n < 1:
        raise ValueError(
            f"context length {length} leaves no room for the haystack: it must be "
            f"> {buffer + len(needle)} (buffer {buffer} + needle {len(needle)})"
        )
    if n > len(haystack):
        raise ValueError(
            f"context length {length} needs {n} haystack tokens; the haystack has "
            f"only {len(haystack)}"
        )
    cut = list(haystack[:n])
    ends = {i for i in set(cut) if tokenizer.decode([i]).rstrip().endswith(".")}
    body, at = insert_needle(cut, needle, depth, ends.__contains__)
    return NiahPrompt(
        context=[*head_ids, *body],
        question=tail_ids,
        needle_start=len(head_ids) + at,
        needle_depth=100.0 * at / n,
    )
