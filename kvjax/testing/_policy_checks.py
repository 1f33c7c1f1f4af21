"""`check_policy`: the properties every built-in policy is tested for, as a library function, so
a policy written outside kvjax can be held to the same contract."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention import AttnStats
from kvjax.generate import GenerateConfig, cache_spec_for, generate, new_cache, score_tokens
from kvjax.generate._loop import _generate
from kvjax.models import TINY_LLAMA, ModelConfig, Params, forward, init_params
from kvjax.policies import FullPolicy, Policy

CHECKS = ("matches_full", "within_budget", "compiles_once", "attention_mass_declared")
PolicyLike = Policy | Callable[[int], Policy]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckResult:
    """One check's outcome. Attributes: name (one of CHECKS), status ("pass", "fail", "skip"),
    detail (what was measured)."""

    name: str
    status: str
    detail: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyReport:
    """Attributes: policy (its repr), results (one per check run, in CHECKS order)."""

    policy: str
    results: tuple[CheckResult, ...]

    @property
    def failed(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.results if r.status == "fail")

    @property
    def ok(self) -> bool:
        return not self.failed

    def __str__(self) -> str:
        rows = [f"{r.status:4}  {r.name:24} {r.detail}" for r in self.results]
        return "\n".join([f"check_policy({self.policy})", *rows])


def check_policy(
    policy: PolicyLike,
    *,
    budget: int = 16,
    nll_atol: float = 1e-5,
    checks: Sequence[str] = CHECKS,
    model: tuple[ModelConfig, Params] | None = None,
    raise_on_failure: bool = True,
) -> PolicyReport:
    """Run the generic policy checks on a tiny random Llama (float32).

    * `matches_full`: with a budget of max(64, budget) tokens, more than the 30-token sequences,
      teacher-forced NLL (chunks of 1 and 4 tokens) equals the full cache's within `nll_atol`.
    * `within_budget`: generating past `budget`, the occupied slots per KV head never exceed the
      policy's budget (`max_budget(layer)` where it has one) — or its live bytes never exceed
      `live_bytes_bound` — and never drop to zero; live bytes equal slots × bytes per token
      (full precision: 2·D·itemsize; INT8: 2·D + two float32 scales).
    * `compiles_once`: three prompts of other lengths reuse one compiled generate.
    * `attention_mass_declared`: a policy with `uses_attention_mass = False` writes the same
      cache whatever the attention mass says; one with True keeps other tokens under spiky
      masses than under zeros.

    Args:
        policy: a policy (rebuilt at each budget with `dataclasses.replace(policy, budget=...)`
            when it has a `budget` field) or a function budget -> policy.
        budget: the small budget (tokens per KV head) that forces evictions.
        nll_atol: largest |ΔNLL| accepted by `matches_full` (quantizing policies: ~0.05).
        checks: which of CHECKS to run.
        model: (config, params) to run on instead of the tiny random Llama.
        raise_on_failure: raise AssertionError (with the report) if any check fails.

    Returns:
        The report (printable); `report.ok` is True when nothing failed.

    Raises:
        TypeError: `policy` is neither a Policy nor a function returning one.
        ValueError: an unknown check name or a budget < 1.
        AssertionError: a check failed (with raise_on_failure).
    """
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise ValueError(f"check_policy: unknown checks {unknown}; choose from {CHECKS}")
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"check_policy: budget must be an int >= 1, got {budget!r}")
    build, budgeted = _builder(policy)
    config, params = model or (TINY_LLAMA, init_params(TINY_LLAMA, jax.random.key(0)))
    run = {
        "matches_full": lambda: _matches_full(build(max(64, budget)), config, params, nll_atol),
        "within_budget": lambda: _within_budget(build(budget), budgeted, config, params, budget),
        "compiles_once": lambda: _compiles_once(build(budget), config, params),
        "attention_mass_declared": lambda: _mass_declared(build(budget), config, budget),
    }
    results = tuple(run[name]() for name in CHECKS if name in checks)
    report = PolicyReport(policy=repr(build(budget)), results=results)
    if raise_on_failure and not report.ok:
        raise AssertionError(f"policy checks failed: {', '.join(report.failed)}\n{report}")
    return report


def _builder(policy: PolicyLike) -> tuple[Callable[[int], Policy], bool]:
    """(budget -> policy, whether the policy has a budget)."""
    if isinstance(policy, Policy):
        if "budget" in {f.name for f in dataclasses.fields(policy)}:
            return (lambda b: dataclasses.replace(policy, budget=b)), True
        return (lambda b: policy), False
    if not callable(policy):
        raise TypeError(
            f"check_policy: policy must be a Policy or a function budget -> Policy, "
            f"got {type(policy).__name__}"
        )

    def build(b: int) -> Policy:
        p = policy(b)
        if not isinstance(p, Policy):
            raise TypeError(
                f"check_policy: policy({b}) returned a {type(p).__name__}, not a Policy"
            )
        return p

    return build, True


def _result(name: str, ok: bool, detail: str) -> CheckResult:
    return CheckResult(name=name, status="pass" if ok else "fail", detail=detail)


def _matches_full(policy, config, params, atol) -> CheckResult:
    ids = np.random.default_rng(7).integers(0, config.vocab_size, size=(2, 30))
    want = _full_nll(config, params, ids)
    worst = 0.0
    for chunk in (1, 4):  # decode steps, and multi-token writes
        got = score_tokens(config, params, ids, policy=policy, chunk=chunk, segment=8).nll
        worst = max(worst, float(np.max(np.abs(np.asarray(got) - want))))
    return _result("matches_full", worst <= atol, f"max |ΔNLL| = {worst:.2e} (atol {atol:g})")


def _full_nll(config, params, ids: np.ndarray) -> np.ndarray:
    """[B, S-1] NLL of tokens 1.. from one forward pass over the whole sequence (no eviction)."""
    b, s = ids.shape
    dtype = jax.tree.leaves(params)[0].dtype
    cache = new_cache(config, FullPolicy(), batch=b, max_len=s, dtype=dtype)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    run = jax.jit(forward, static_argnums=0)
    logits = run(config, params, jnp.asarray(ids, jnp.int32), pos, pos >= 0, cache).logits
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -np.take_along_axis(np.asarray(logp), ids[:, 1:, None], axis=-1)[..., 0]


# Batches of two prompts; every batch pads to 24 tokens (3 chunks of 8), so one compiled
# generate serves them all. The first is the one `within_budget` inspects.
_PROMPT_LENGTHS = ((24, 6), (17, 3), (20, 9))
_GEN = GenerateConfig(max_new_tokens=20, chunk_size=8)


def _prompts(lengths, vocab: int) -> list[list[int]]:
    return [[(3 * i + t) % vocab for t in range(1, n + 1)] for i, n in enumerate(lengths)]


def _within_budget(policy, budgeted, config, params, budget) -> CheckResult:
    prompts = _prompts(_PROMPT_LENGTHS[0], config.vocab_size)
    out = generate(config, params, prompts, policy=policy, gen=_GEN)
    slots = np.asarray(out.telemetry.live_slots)  # [N, B, L, tiers]
    per_head = slots[..., :2].sum(-1) / config.num_kv_heads  # [N, B, L]
    notes = [f"most slots per head {per_head.max():g}"]
    ok = per_head.max() > 0
    if budgeted:
        spec = _spec(config, params, policy, len(prompts), 24 + _GEN.max_new_tokens)
        bound = policy.live_bytes_bound(spec)
        if bound is not None:
            ok &= out.telemetry.live_bytes().max() <= bound
            notes.append(f"live bytes {out.telemetry.live_bytes().max()} <= bound {bound}")
        else:
            cap = [
                getattr(policy, "max_budget", lambda i: budget)(i)
                for i in range(per_head.shape[-1])
            ]
            ok &= bool(np.all(per_head <= np.asarray(cap)[None, None, :]))
            notes.append(f"budget per layer {cap}")
    if slots[..., 2].any():
        notes.append("bytes formula skipped (low-bit tier)")
    else:
        d, item = config.head_dim, jax.tree.leaves(params)[0].dtype.itemsize
        want = slots[..., 0].sum(-1) * 2 * d * item + slots[..., 1].sum(-1) * (2 * d + 8)
        same = np.array_equal(out.telemetry.live_bytes(), want)
        ok &= same
        notes.append("live bytes = formula" if same else "live bytes != slots x bytes per token")
    return _result("within_budget", bool(ok), "; ".join(notes))


def _spec(config, params, policy, batch, max_len):
    dtype = jax.tree.leaves(params)[0].dtype
    return cache_spec_for(config, policy, batch=batch, max_len=max_len, dtype=dtype)


def _compiles_once(policy, config, params) -> CheckResult:
    run = lambda lengths: generate(
        config, params, _prompts(lengths, config.vocab_size), policy=policy, gen=_GEN
    )
    run(_PROMPT_LENGTHS[0])  # compiled already when within_budget ran
    before = _generate._cache_size()
    for lengths in _PROMPT_LENGTHS[1:]:
        run(lengths)
    extra = _generate._cache_size() - before
    shown = ", ".join(f"{a}+{b}" for a, b in _PROMPT_LENGTHS)
    return _result("compiles_once", extra == 0, f"{extra} recompilations for prompts of {shown}")


def _mass_declared(policy, config, budget) -> CheckResult:
    steps = max(80, 4 * budget)
    cache = new_cache(config, policy, batch=2, max_len=steps + 16, dtype=jnp.float32)
    layer0, state = cache.layers[0], cache.policy_state
    h, d = layer0.num_kv_heads, layer0.k.shape[3]
    sizes = [t.pos.size for t in (layer0, layer0.int8, layer0.lowbit) if t is not None]
    n_mass = max([*sizes, 2 * h]) + 1

    @jax.jit
    def step(layer, kv, pos, masses):
        tier = lambda t, m: None if t is None else m[: t.pos.size].reshape(t.pos.shape)
        st = AttnStats(
            slot_mass=masses[: layer.pos.size].reshape(layer.pos.shape),
            new_mass=masses[: 2 * h].reshape(2, h, 1),
            lse=jnp.zeros((2, 1, config.num_heads)),
            int8_mass=tier(layer.int8, masses[::-1]),
            lowbit_mass=tier(layer.lowbit, masses[1:]),
        )
        valid = jnp.ones((2, 1), bool)
        return policy.write(layer, kv[0], kv[1], pos, valid, st, state, layer_index=0)

    def run(spiky: bool) -> list[np.ndarray]:
        rng = np.random.default_rng(1)  # the same keys and values in both runs
        layer = layer0
        for t in range(steps):  # one token a step, well past the budget
            kv = jnp.asarray(rng.standard_normal((2, 2, 1, h, d)), jnp.float32)
            masses = rng.exponential(size=n_mass) ** 3 * spiky
            layer = step(
                layer, kv, jnp.full((2, 1), t, jnp.int32), jnp.asarray(masses, jnp.float32)
            )
        return [np.asarray(x) for x in jax.tree.leaves(layer) if x.dtype == jnp.int32]

    same = all(np.array_equal(a, b) for a, b in zip(run(False), run(True), strict=True))
    declared = policy.uses_attention_mass
    ok = same == (not declared)
    seen = "the same cache" if same else "a different cache"
    detail = f"uses_attention_mass={declared}; spiky vs zero mass gave {seen}"
    return _result("attention_mass_declared", ok, detail)
