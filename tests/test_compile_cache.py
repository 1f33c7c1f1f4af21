"""The persistent compilation cache: where it lives, `off`, bad locations, and a second process
that loads the first one's executables instead of compiling them."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from kvjax._compile_cache import (
    ENV_VAR,
    SCAN_XLA_FLAG,
    default_cache_dir,
    enable_compilation_cache,
    prefer_cublas_for_scan,
    resolve_cache_dir,
)
from kvjax.cli import main

# One CLI run in a fresh process; prints the number of persistent-cache hits and misses JAX
# recorded. Every compile is written (threshold 0), so the tiny model's executables qualify.
CHILD = """
import json, sys
import jax.monitoring
import kvjax._compile_cache as cc
cc.MIN_COMPILE_SECONDS = 0.0
events = {"hits": 0, "misses": 0}
names = {"/jax/compilation_cache/cache_hits": "hits",
         "/jax/compilation_cache/cache_misses": "misses"}
def listen(event, **kw):
    if event in names:
        events[names[event]] += 1
jax.monitoring.register_event_listener(listen)
from kvjax.cli import main
code = main(sys.argv[1:])
print("EVENTS " + json.dumps(events))
sys.exit(code)
"""
BENCH = [
    "bench", "decode", "--preset", "tiny-llama", "--policy", "window", "--budget", "16",
    "--contexts", "64", "--fill-chunk", "32", "--steps", "2", "--copy-mib", "1", "--json",
]  # fmt: skip


def _run_child(*argv: str, env_cache: str | None = None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env["JAX_PLATFORMS"] = "cpu"
    if env_cache is not None:
        env[ENV_VAR] = env_cache
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("EVENTS ")][-1]
    return json.loads(line.removeprefix("EVENTS ")), proc.stdout


def _entries(path: pathlib.Path) -> set[str]:
    return {p.name for p in path.rglob("*") if p.is_file()}


def test_second_process_loads_the_first_ones_executables(tmp_path):
    cache = tmp_path / "xla"
    first, out1 = _run_child(*BENCH, env_cache=str(cache))
    written = _entries(cache)
    assert first["misses"] > 0 and first["hits"] == 0, first
    assert len(written) >= first["misses"], (written, first)
    second, out2 = _run_child(*BENCH, env_cache=str(cache))
    # Every executable the second run needs was compiled by the first, none compiled again.
    assert second == {"hits": first["misses"], "misses": 0}, (first, second)
    assert _entries(cache) >= written
    # and the results are those of a compiled run (same policy, same shapes)
    row1, row2 = (
        json.loads(out1[: out1.rindex("EVENTS")])[0],
        json.loads(out2[: out2.rindex("EVENTS")])[0],
    )
    assert (row1["live_kv_bytes"], row1["policy"]) == (row2["live_kv_bytes"], row2["policy"])


def test_flag_before_or_after_the_command_and_off(monkeypatch, tmp_path):
    from kvjax.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["ppl"]).compilation_cache is None  # then the env var, then the default
    assert parse(["--compilation-cache", "a", "ppl"]).compilation_cache == "a"
    assert parse(["ppl", "--compilation-cache", "b"]).compilation_cache == "b"
    assert (
        parse(
            ["--compilation-cache", "a", "bench", "decode", "--compilation-cache", "c"]
        ).compilation_cache
        == "c"
    )
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "never"))
    assert enable_compilation_cache("off") is None
    assert not jax.config.jax_enable_compilation_cache and not (tmp_path / "never").exists()


@pytest.mark.parametrize(
    ("location", "env", "expected"),
    [
        (None, None, "default"),
        (None, "", "default"),
        (None, "/x/y", "/x/y"),
        ("/a/b", "/x/y", "/a/b"),
        ("OFF", None, None),
        (None, "off", None),
        ("~/c", None, "~/c"),
    ],
)
def test_resolve_cache_dir_precedence(monkeypatch, location, env, expected):
    if env is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, env)
    got = resolve_cache_dir(location)
    if expected == "default":
        assert got == default_cache_dir()
    elif expected is None:
        assert got is None
    else:
        assert got == pathlib.Path(expected).expanduser()


def test_default_dir_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "kvjax" / "jax"


def test_bad_locations_fail_with_one_line(capsys, tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for location in (str(a_file), "  "):
        code = main(["--compilation-cache", location, "ppl", "--policy", "window"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "compilation cache" in err, err
    with pytest.raises(TypeError, match="compilation cache location"):
        resolve_cache_dir(3)


@pytest.mark.parametrize(
    "before, after, added",
    [
        (None, SCAN_XLA_FLAG, True),
        ("--xla_dump_to=/tmp/d", f"--xla_dump_to=/tmp/d {SCAN_XLA_FLAG}", True),
        # the user's own choice of the option is kept, whatever its value
        ("--xla_gpu_enable_triton_gemm=true", "--xla_gpu_enable_triton_gemm=true", False),
    ],
)
def test_scan_prefers_cublas_unless_the_user_chose(monkeypatch, before, after, added):
    if before is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", before)
    assert prefer_cublas_for_scan() is added
    assert os.environ["XLA_FLAGS"] == after


def test_cli_scan_layers_sets_the_flag_before_running(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    parser_args = ["generate", "--scan-layers", "--prompt", "hi", "--model", "/nonexistent.gguf"]
    assert main(parser_args) == 2  # the missing model file; the flag was set before
    assert SCAN_XLA_FLAG in os.environ["XLA_FLAGS"]
