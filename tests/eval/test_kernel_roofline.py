"""scripts/kernel_roofline.py: each cell's µs, speed against the same run's cuDNN row and
fraction of the floor (the row's bytes at the same shape's copy bandwidth, read + written),
recomputed here by hand; --best keeps a row's fastest knob setting and names it; a file that
is not `bench kernel` output is one clear error naming it."""

import json
import runpy
import sys

import pytest

SCRIPT = "scripts/kernel_roofline.py"


def _r(row, us, nbytes, knobs=None, context=16384):
    return dict(row=row, knobs=json.dumps(knobs or {}), batch=8, context=context, q_heads=32,
                kv_heads=8, head_dim=128, device="GPU X", us=us, bytes_read=nbytes,
                tbps=None, error=None)  # fmt: skip


def _run(monkeypatch, capsys, args):
    monkeypatch.setattr(sys, "argv", [SCRIPT, *args])
    try:
        runpy.run_path(SCRIPT, run_name="__main__")
    except SystemExit as e:
        if e.code is not None:  # an error: the caller's pytest.raises sees it
            raise
    return capsys.readouterr().out


def test_cells_are_speed_and_fraction_of_the_floor(tmp_path, monkeypatch, capsys):
    slots = 8 * 16384 * 8
    rows = [
        _r("copy", 400.0, 512 * slots),
        _r("cudnn-bf16", 220.0, 512 * slots),
        _r("int4", 110.0, 148 * slots),
        _r("int4", 100.0, 148 * slots, {"fold_keys": 1}),
        _r("int4", 1.0, 148 * slots, {"fold_keys": 0}) | {"error": "boom", "us": None},
    ]
    path = tmp_path / "k.json"
    path.write_text(json.dumps(rows))
    out = _run(monkeypatch, capsys, [str(path)])
    bw = 2 * 512 * slots / 400.0  # bytes per µs, read + written
    floor = 148 * slots / bw
    assert "device: GPU X" in out
    assert f"| int4 (148) | 110.0 ({220 / 110:.2f}×, {floor / 110:.0%}) |" in out
    assert f"| int4 [fold_keys=1] (148) | 100.0 ({220 / 100:.2f}×, {floor / 100:.0%}) |" in out
    assert "boom" not in out and "fold_keys=0" not in out  # a failed row has no cell
    best = _run(monkeypatch, capsys, [str(path), "--best", "--rows", "int4"])
    assert f"| int4 (148) | 100.0 ({220 / 100:.2f}×, {floor / 100:.0%}) [fold_keys=1] |" in best


def test_not_bench_kernel_output_is_one_clear_error(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="not a `bench kernel` --out file"):
        _run(monkeypatch, capsys, [str(bad)])
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(SystemExit, match="cannot read"):
        _run(monkeypatch, capsys, [str(broken)])
