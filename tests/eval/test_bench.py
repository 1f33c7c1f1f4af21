"""The decode benchmark measures what it says: live/physical bytes follow the formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.eval import bench_decode
from kvjax.policies import make_policy


@pytest.mark.parametrize("name,budget", [("full", None), ("window", 32), ("streaming", 32)])
def test_bench_decode_byte_accounting(tiny_llama, name, budget):
    config, params = tiny_llama
    policy = make_policy(name, budget)
    r = bench_decode(
        config,
        params,
        policy,
        context=128,
        batch=2,
        steps=4,
        budget=budget,
        fill_chunk=64,
        copy_bytes=1 << 20,
    )
    slot = 2 * config.head_dim * 4  # K+V float32
    # live = what the next step attends: the cache plus its own token (a budget of 32: 32)
    kept = 128 + 1 if name == "full" else 32
    assert r.live_kv_bytes == 2 * config.num_layers * config.num_kv_heads * kept * slot
    capacity = policy.capacity(128 + 4 * 4 + 1)  # room for the timed and policy-only steps
    # Physical: K, V data + int32 positions + float32 scores, per slot, plus [B] lengths.
    per_slot = slot + 4 + 4
    assert r.physical_kv_bytes == (
        2 * config.num_layers * config.num_kv_heads * capacity * per_slot + 2 * 4
    )
    assert r.ms_per_step > 0 and r.tokens_per_s == pytest.approx(2e3 / r.ms_per_step)
    assert r.policy_ms_per_step > 0
    assert r.peak_device_bytes is None or r.peak_device_bytes >= r.physical_kv_bytes


def test_bench_decode_reports_its_phases(tiny_llama, capsys):
    """Long runs show where the time goes: the fill and the first (compiling) decode call are
    timed and, with progress, announced on stderr."""
    config, params = tiny_llama
    kw = dict(context=128, batch=1, steps=4, fill_chunk=64, copy_bytes=1 << 20)
    r = bench_decode(config, params, make_policy("window", 32), progress=True, **kw)
    err = capsys.readouterr().err
    assert "[window] filled 128 tokens in" in err
    assert "first call" in err and "ms/step" in err
    assert r.fill_s > 0
    # the first call compiles the loop and then runs the same steps the timed call runs
    assert r.first_call_s > r.ms_per_step * r.steps / 1e3


def test_bench_decode_scan_layers_runs_the_stacked_cache(tiny_llama):
    """`scan_layers`: fill, decode and the policy alone over a stacked cache (the layer scan);
    the bytes are the unrolled run's (a window's live bytes do not depend on the fill's draws)."""
    config, params = tiny_llama
    kw = dict(context=128, batch=2, steps=2, budget=32, fill_chunk=64, copy_bytes=1 << 20)
    want = bench_decode(config, params, make_policy("window", 32), **kw)
    got = bench_decode(config, params, make_policy("window", 32), scan_layers=True, **kw)
    assert got.scan_layers and not want.scan_layers
    assert got.live_kv_bytes == want.live_kv_bytes
    assert got.physical_kv_bytes == want.physical_kv_bytes
    assert got.ms_per_step > 0 and got.policy_ms_per_step > 0


def test_bench_rejects_ragged_fill(tiny_llama):
    config, params = tiny_llama
    with pytest.raises(ValueError, match="multiple of fill_chunk"):
        bench_decode(
            config, params, make_policy("full"), context=100, batch=1, steps=1, fill_chunk=64
        )


@pytest.mark.parametrize("name,budget", [("confkv", 160), ("qevict", 64)])
def test_bench_decode_runs_tiered_policies(tiny_llama, name, budget):
    """Policies with INT8 or low-bit tiers get their tiers' attention mass in the synthetic fill;
    live bytes stay within what the budget allows."""
    config, params = tiny_llama
    policy = make_policy(name, budget, num_layers=config.num_layers)
    r = bench_decode(
        config,
        params,
        policy,
        context=256,
        batch=1,
        steps=4,
        budget=budget,
        fill_chunk=64,
        copy_bytes=1 << 20,
    )
    slot = 2 * config.head_dim * 4
    assert 0 < r.live_kv_bytes <= config.num_layers * config.num_kv_heads * budget * slot


def test_bench_kernel_rows_bytes_and_errors():
    from kvjax.eval._bench_kernel import bench_kernel

    rows = ("copy", "xla-bf16", "xla-dequant-int8", "pallas-int4", "pallas-int4-f32stats")
    rows += ("pallas-bf16-pooled", "mgpu-int4", "mgpu-int4-codes", "mgpu-int4-codes-auto+logits")
    rows += ("mgpu-tm-bf16", "pallas-bf16-fc", "pallas-int8-fc", "pallas-int2+logits")
    rows += ("mgpu-tm-int8+logits", "pallas-int8+logits", "mgpu-pages-int2+logits")
    with jax.numpy_dtype_promotion("standard"):  # jax.nn's XLA attention promotes implicitly
        res = {
            r.row: r
            for r in bench_kernel(
                batch=1,
                context=64,
                q_heads=4,
                kv_heads=2,
                head_dim=64,
                page=16,
                value_group=32,
                rows=rows,
                iters=1,
                repeats=1,
            )  # fmt: skip
        }
    assert set(res) == set(rows)
    bf16 = 2 * 1 * 2 * 64 * 64 * 2  # K and V
    assert res["copy"].bytes_read == res["xla-bf16"].bytes_read == bf16
    for name in ("copy", "xla-bf16", "xla-dequant-int8"):
        assert res[name].error is None and res[name].us > 0 and res[name].tbps > 0
    # INT4 codes are a quarter of BF16; per KV head (2), a scale and a zero per page·channel
    # (4 pages × 64) and per token·group (64 × 2), bfloat16 as stored (float32 in the
    # -f32stats row); an int32 pos per slot.
    stats = 2 * 2 * (4 * 64 + 64 * 2)
    assert res["pallas-int4"].bytes_read == bf16 // 4 + stats * 2 + 2 * 64 * 4
    assert res["pallas-int4-f32stats"].bytes_read == bf16 // 4 + stats * 4 + 2 * 64 * 4
    # INT2 with logits (QEvict's read): an eighth of BF16's codes, the same statistics
    assert res["pallas-int2+logits"].bytes_read == bf16 // 8 + stats * 2 + 2 * 64 * 4
    # the same tier, read by the Mosaic GPU kernel of 8-token pages
    assert res["mgpu-pages-int2+logits"].bytes_read == res["pallas-int2+logits"].bytes_read
    # The slots-on-M Mosaic GPU kernel reads the full tier: K/V and an int32 position a slot.
    assert res["mgpu-tm-bf16"].bytes_read == bf16 + 2 * 64 * 4
    # The fused combine reads the same tier (the partials are not counted in any row).
    assert res["pallas-bf16-fc"].bytes_read == bf16 + 2 * 64 * 4
    assert res["pallas-int8-fc"].bytes_read == bf16 // 2 + 2 * 64 * (4 + 4 + 4)
    # the INT8 tier read with logits, by Triton and by the slots-on-M Mosaic GPU kernel
    assert res["mgpu-tm-int8+logits"].bytes_read == res["pallas-int8-fc"].bytes_read
    assert res["pallas-int8+logits"].bytes_read == res["pallas-int8-fc"].bytes_read
    # The pool holds the same slots: K/V, then an int32 position and owner id per slot.
    assert res["pallas-bf16-pooled"].bytes_read == bf16 + 2 * (2 * 64 * 4)
    # The Mosaic layouts (one 64-token page, value groups of 64): packed bytes or int4 arrays
    # hold the same bits; bfloat16 statistics per channel (keys) and token (values); positions.
    mg_stats = 2 * 2 * (64 + 64)
    assert res["mgpu-int4"].bytes_read == bf16 // 4 + mg_stats * 2 + 2 * 64 * 4
    assert res["mgpu-int4-codes"].bytes_read == res["mgpu-int4"].bytes_read
    # the logits it writes are not read bytes
    assert res["mgpu-int4-codes-auto+logits"].bytes_read == res["mgpu-int4"].bytes_read
    if jax.default_backend() == "cpu":  # compiled Triton kernels cannot run here: an error row
        assert "Error" in res["pallas-int4"].error
        assert "Error" in res["pallas-int2+logits"].error
        assert "Error" in res["pallas-bf16-pooled"].error
        assert "Error" in res["mgpu-pages-int2+logits"].error  # (16-token pages here, too)


def test_timed_loop_unrolled_is_the_same_chain_of_calls():
    """`unroll` calls per loop iteration: the same chain of `iters` calls (each query depends
    on the previous output) as a Python loop, with `unroll` copies of the call in the loop's
    body; an unroll that does not divide `iters` is refused."""
    from kvjax.eval._bench_kernel import _loop, _timed, bench_kernel

    w = jnp.linspace(0.5, 1.5, 8, dtype=jnp.float32).reshape(1, 1, 8)
    q = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32).reshape(1, 1, 8)
    want = np.asarray(q, np.float64)
    for _ in range(4):
        want = want + 1e-3 * np.tanh(want * np.asarray(w, np.float64))
    for unroll in (1, 2, 4):
        loop = _loop(lambda q, data: jnp.tanh(q * data), 4, unroll)
        np.testing.assert_allclose(np.asarray(loop(q, w)), want, rtol=1e-6)
        assert loop.lower(q, w).as_text().count("stablehlo.tanh") == unroll
        sec, first = _timed(lambda q, data: jnp.tanh(q * data), q, w, 4, 1, unroll)
        assert sec > 0 and first > 0
    with pytest.raises(ValueError, match="unroll must be a positive divisor of iters=200, got 3"):
        bench_kernel(batch=1, context=64, rows=(), unroll=3)


@pytest.mark.parametrize(
    "knob, rows, message",
    [
        ("int8_qk", ("pallas-int4", "pallas-bf16"), "int8_qk applies to the INT8 and low-bit rows"),
        ("stack_pages", ("pallas-int2", "pallas-int8"), "stack_pages applies to the low-bit"),
        ("v_words", ("pallas-int8", "pallas-int2"), "v_words applies to the INT8 rows only"),
    ],
)
def test_bench_kernel_rejects_a_row_specific_knob_on_other_rows(knob, rows, message):
    from kvjax.eval._bench_kernel import bench_kernel

    with pytest.raises(ValueError, match=message):
        bench_kernel(batch=1, context=64, rows=(), sweep=({knob: 1},), sweep_rows=rows)


def test_hlo_loop_launches_counts_the_decode_loop_body():
    """A compiled loop whose body holds a cond and a loop of device-side trip count, next to a
    smaller loop: the larger loop's body is counted, its inner loop reported as dynamic."""
    from kvjax.eval._bench import hlo_loop_launches

    def body(_, x):
        x = jax.lax.cond(x[0] > 0, lambda y: y * 2.0, lambda y: y - 1.0, x)
        n = (x[1] > 0).astype(jnp.int32)  # known only on the device
        return jax.lax.fori_loop(0, n, lambda _, y: jnp.sin(y), x)

    def f(x):
        x = jax.lax.fori_loop(0, 3, lambda _, y: y + 1.0, x)
        return jax.lax.fori_loop(0, 5, body, x)

    counts = hlo_loop_launches(jax.jit(f).lower(jnp.ones(8)).compile().as_text())
    assert counts.get("conditional") == 1
    assert counts.get("while (dynamic)") == 1
    with pytest.raises(ValueError, match="no while loop"):
        hlo_loop_launches(jax.jit(jnp.sin).lower(jnp.ones(8)).compile().as_text())


def test_cli_sweep_grid_takes_every_bench_knob_and_names_bad_entries():
    from kvjax.cli._bench import _grid
    from kvjax.eval._bench_kernel import SWEEP_KNOBS

    assert _grid(["block_k=32,64", "v_words=0,1"]) == [
        {"block_k": 32, "v_words": 0},
        {"block_k": 32, "v_words": 1},
        {"block_k": 64, "v_words": 0},
        {"block_k": 64, "v_words": 1},
    ]
    assert all(_grid([f"{k}=1"]) == [{k: 1}] for k in SWEEP_KNOBS)
    for bad in ("fold_scales=0,1", "block_k", "num_warps="):
        with pytest.raises(SystemExit, match="bad --sweep entry"):
            _grid([bad])


def test_policy_from_spec_reads_the_write_kernel_and_budgetless_names():
    from kvjax.eval._bench import policy_from_spec

    pol = policy_from_spec("confkv@pallas", 1580, num_layers=2)
    assert (type(pol).__name__, pol.write_kernel) == ("ConfKVPolicy", "pallas")
    assert policy_from_spec("h2o", 819, num_layers=2).write_kernel == "auto"
    assert type(policy_from_spec("full", None, num_layers=2)).__name__ == "FullPolicy"
    with pytest.raises(ValueError, match="write_kernel must be one of"):
        policy_from_spec("h2o@cuda", 819, num_layers=2)


def test_policy_from_spec_sets_fields_as_the_cli_reads_them():
    from kvjax.eval._bench import policy_from_spec

    pol = policy_from_spec("streaming", 64, num_layers=2, sets="sinks=2,position_shift=true")
    assert (pol.budget, pol.sinks, pol.position_shift) == (64, 2, True)
    pol = policy_from_spec("confkv@pallas", 1580, num_layers=2, sets="tau=0.6")
    assert (pol.write_kernel, pol.tau) == ("pallas", 0.6)
    with pytest.raises(ValueError, match="'h2o'.*unexpected keyword argument 'nonsense'"):
        policy_from_spec("h2o", 64, num_layers=2, sets="nonsense=3")
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        policy_from_spec("h2o", 64, num_layers=2, sets="sinks")


def test_bench_rows_record_the_tuning_overrides_they_ran_under(tiny_llama, monkeypatch):
    """An A/B run's rows say which side they are: the KVJAX_TUNING overrides in effect
    (normalized, "" without), in bench decode's and bench kernel's rows alike."""
    from kvjax.eval._bench_kernel import bench_kernel

    config, params = tiny_llama
    kw = dict(context=64, batch=1, steps=1, budget=32, fill_chunk=64, copy_bytes=1 << 20)
    kern = dict(batch=1, context=64, q_heads=4, kv_heads=2, head_dim=64, rows=("copy",))
    kern.update(iters=1, repeats=1)
    monkeypatch.delenv("KVJAX_TUNING", raising=False)
    assert bench_decode(config, params, make_policy("window", 32), **kw).tuning == ""
    assert bench_kernel(**kern)[0].tuning == ""
    monkeypatch.setenv("KVJAX_TUNING", " join_new_token=0 ,, mgpu_stages=3")
    want = "join_new_token=0,mgpu_stages=3"
    assert bench_decode(config, params, make_policy("window", 32), **kw).tuning == want
    assert bench_kernel(**kern)[0].tuning == want
