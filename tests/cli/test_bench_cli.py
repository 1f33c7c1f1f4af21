"""`kvjax bench decode` end to end on the tiny random Llama checkpoint: its readable line and
its JSON rows name the KVJAX_TUNING overrides the run took."""

import json

from kvjax.cli import main


def test_bench_decode_prints_and_records_the_tuning_overrides(
    capsys, monkeypatch, goldens, tmp_path
):
    out = tmp_path / "rows.json"
    argv = ["bench", "decode", "--model", str(goldens / "llama_tiny"), "--contexts", "64"]
    argv += ["--batch", "1", "--steps", "1", "--policy", "window", "--budget", "32"]
    argv += ["--copy-mib", "1", "--dtype", "float32", "--out", str(out)]
    for overrides in ("", "join_new_token=0"):
        monkeypatch.setenv("KVJAX_TUNING", overrides)
        assert main(argv) == 0
        line = [x for x in capsys.readouterr().out.splitlines() if "ms/step" in x]
        assert len(line) == 1 and line[0].lstrip().startswith("window ctx=")
        assert ("KVJAX_TUNING" in line[0]) == bool(overrides)
        if overrides:
            assert line[0].endswith(f", KVJAX_TUNING {overrides}")
        assert [r["tuning"] for r in json.loads(out.read_text())] == [overrides]
