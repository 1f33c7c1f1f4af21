"""The docs stay true: every relative link (file and #anchor) resolves, the policy written in
docs/policies.md runs and behaves, and no page narrates runs by number instead of by date."""

import collections
import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES += sorted((ROOT / "docs").glob("*/*.md"))
# Pages written in parallel with these docs; a link to one is only checked once it exists.
PENDING = {ROOT / "docs" / "api.md", ROOT / "docs" / "notebooks.md"}


def _strip_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lowercased, punctuation dropped, spaces to
    hyphens, repeats numbered -1, -2, ..."""
    anchors, seen = set(), collections.Counter()
    for m in re.finditer(r"^#{1,6} +(.+?) *$", _strip_code(text), flags=re.M):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        anchors.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return anchors


def links(text: str) -> list[str]:
    """Inline link targets and reference definitions of a page (code blocks left out)."""
    text = _strip_code(text)
    found = re.findall(r"\]\(([^)\s]+)\)", text)
    return found + re.findall(r"^\[[^\]\n]+\]: (\S+)", text, flags=re.M)


def test_heading_anchors_follow_github():
    text = "# A `b` (H200)\n## Kernels, B = 8\n## A b H200\n```\n# not a heading\n```\n"
    assert heading_anchors(text) == {"a-b-h200", "kernels-b--8", "a-b-h200-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = page.read_text()
    refs = set(re.findall(r"^\[([^\]\n]+)\]: ", text, flags=re.M))
    used = set(re.findall(r"\]\[([^\]\n]+)\]", _strip_code(text)))
    assert used <= refs, f"undefined reference links {sorted(used - refs)}"
    broken = []
    for url in links(text):
        if re.match(r"[a-z]+:", url):
            continue
        path, _, anchor = url.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            if target not in PENDING:
                broken.append(url)
            continue
        if anchor and target.suffix == ".md" and anchor not in heading_anchors(target.read_text()):
            broken.append(url)
    assert not broken, f"{page.name}: broken links {broken}"


def test_no_run_numbers_in_docs():
    # Docs speak of the project, not of numbered runs of work ("sess" + "ion 7" and the like;
    # spelled in two parts so this file does not match its own pattern).
    s = "sess" + "ion"
    pattern = re.compile(
        rf"\b{s} ?[0-9]+|\b{s}s? of (work|tuning)|this {s}|next {s}|last {s}", re.I
    )
    hits = [f"{p.name}: {m.group(0)}" for p in PAGES for m in pattern.finditer(p.read_text())]
    assert not hits


def test_policy_written_in_the_guide_runs(tiny_llama):
    from kvjax.generate import GenerateConfig, generate, score_tokens
    from kvjax.policies import make_policy

    text = (ROOT / "docs" / "policies.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    scope: dict = {}
    exec(compile(code, "docs/policies.md", "exec"), scope)
    policy_cls = scope["PeakAttentionPolicy"]
    config, params = tiny_llama
    ids = np.random.default_rng(3).integers(0, 128, size=(2, 20))
    full = score_tokens(config, params, ids, policy=make_policy("full"), chunk=4, segment=8).nll
    # Budget >= length: nothing is evicted, so the result is the full cache's.
    big = policy_cls(budget=32, recent=4)
    got = score_tokens(config, params, ids, policy=big, chunk=4, segment=8).nll
    np.testing.assert_allclose(np.asarray(got), np.asarray(full), rtol=1e-6, atol=1e-6)
    # Under eviction the cache holds exactly the budget per KV head once it is full.
    out = generate(config, params, [list(range(1, 25))], policy=policy_cls(budget=8, recent=4),
                   gen=GenerateConfig(max_new_tokens=12, chunk_size=8))  # fmt: skip
    per_head = np.asarray(out.telemetry.live_slots)[..., 0] / config.num_kv_heads
    assert per_head.max() == 8
    with pytest.raises(ValueError, match="recent"):
        policy_cls(budget=32, recent=0)
