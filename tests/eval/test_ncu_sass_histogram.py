"""scripts/ncu_sass_histogram.py: executed warp instructions and stall samples summed by opcode
(predicates dropped, modifiers kept) from ncu's source-page CSV, divided by --pages; a file that
is not that CSV is one clear error naming what is missing."""

import json
import runpy
import sys

import pytest

SCRIPT = "scripts/ncu_sass_histogram.py"
HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)",'
    '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed"'
)


def _run(monkeypatch, capsys, args):
    monkeypatch.setattr(sys, "argv", [SCRIPT, *args])
    try:
        runpy.run_path(SCRIPT, run_name="__main__")
    except SystemExit as e:
        if e.code is not None:
            raise
    return capsys.readouterr().out


def _csv(tmp_path, lines, preamble=True):
    path = tmp_path / "sass.csv"
    pre = ['"Kernel Name","kvjax_decode_int2_mgpu_mosaic_gpu_kernel",'] if preamble else []
    path.write_text("\n".join([*pre, HEADER, *lines]) + "\n")
    return path


ROWS = [
    '"0x10","@P0 LOP3.LUT R1, R2, 0x3, RZ, 0xc0, !PT","6","5","1,024"',
    '"0x20","      LOP3.LUT R3, R2, 0xc, RZ, 0xc0, !PT","2","1","1024"',
    '"0x30","@!P1 BRA 0x40","1","1","512"',
    '"0x40","HGMMA.64x8x16.F32.BF16 R24, R28, gdesc[UR8], RZ, !UPT","7","7","256"',
    '"0x50","@UP2 UTMALDG.5D [UR24], [UR10]","4","4","0"',
]


def test_counts_are_summed_by_opcode_and_divided_by_pages(tmp_path, monkeypatch, capsys):
    path = _csv(tmp_path, ROWS)
    got = json.loads(_run(monkeypatch, capsys, [str(path), "--pages", "256", "--json"]))
    # by hand: (1024 + 1024 + 512 + 256 + 0) / 256 warp instructions a page
    assert got["executed_per_page"] == pytest.approx(2816 / 256)
    ops = got["opcodes"]
    assert ops["LOP3.LUT"]["executed"] == pytest.approx(8.0)
    assert ops["LOP3.LUT"]["stalls"] == 8 and ops["LOP3.LUT"]["lines"] == 2
    assert ops["BRA"]["executed"] == pytest.approx(2.0)
    assert ops["HGMMA.64x8x16.F32.BF16"]["executed"] == pytest.approx(1.0)
    assert ops["UTMALDG.5D"]["executed"] == 0 and ops["UTMALDG.5D"]["stalls"] == 4
    assert list(ops)[0] == "LOP3.LUT"  # most executed first
    text = _run(monkeypatch, capsys, [str(path), "--pages", "256"])
    assert "11.0 warp instructions per page (5 SASS lines)" in text
    assert "LOP3.LUT" in text.splitlines()[2]


def test_header_without_a_preamble_is_read_too(tmp_path, monkeypatch, capsys):
    path = _csv(tmp_path, ROWS[:1], preamble=False)
    got = json.loads(_run(monkeypatch, capsys, [str(path), "--json"]))
    assert got["executed_per_page"] == 1024


def test_bad_input_is_one_clear_error(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit, match="no file"):
        _run(monkeypatch, capsys, [str(tmp_path / "none.csv")])
    bad = tmp_path / "bad.csv"
    bad.write_text('"a","b"\n"1","2"\n')
    with pytest.raises(SystemExit, match="no header with a 'Source' column"):
        _run(monkeypatch, capsys, [str(bad)])
    nocount = tmp_path / "nocount.csv"
    nocount.write_text('"Address","Source"\n"0x10","NOP"\n')
    with pytest.raises(SystemExit, match="Instructions Executed"):
        _run(monkeypatch, capsys, [str(nocount)])
    with pytest.raises(SystemExit, match="--pages must be > 0"):
        _run(monkeypatch, capsys, [str(_csv(tmp_path, ROWS)), "--pages", "0"])
