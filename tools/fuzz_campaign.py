"""Run the reader fuzzers of tests/reliability/test_fuzz_readers.py for N hypothesis examples
each, printing progress and a summary line per reader (counts of loaded files and clear errors).

    .venv/bin/python tools/fuzz_campaign.py 1000 gguf gguf_tokenizer safetensors config \
        tokenizer_json scorer checkpoint
"""

import collections
import pathlib
import shutil
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests"))
import conftest  # noqa: E402,F401  (the test suite's JAX settings)
import reliability.test_fuzz_checkpoints as fc  # noqa: E402
import reliability.test_fuzz_readers as fz  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def main(n: int, names: list[str]) -> None:
    tmp = pathlib.Path("/tmp/kvjax_fuzz")
    tmp.mkdir(exist_ok=True)
    gguf = fz.tiny_gguf_bytes(tmp)
    vocab = fz.vocab_gguf_bytes(tmp)
    tokjson = fz.tokenizer_json_bytes(tmp, vocab)
    inner = lambda t: t.hypothesis.inner_test  # noqa: E731
    pristine = []

    def saved():  # one pristine checkpoint, written on first use
        if not pristine:
            shutil.rmtree(tmp / "ckpt", ignore_errors=True)
            pristine.append(fc.save_pristine(tmp / "ckpt"))
        return pristine[0]

    targets = {
        "gguf": lambda data: inner(fz.test_gguf_reader_on_hostile_files)(gguf, tmp, data),
        "gguf_tokenizer": lambda data: inner(fz.test_gguf_tokenizer_reader_on_hostile_files)(
            vocab, tmp, data
        ),
        "safetensors": lambda data: inner(fz.test_safetensors_reader_on_hostile_files)(tmp, data),
        "config": lambda data: inner(fz.test_config_json_reader_on_hostile_values)(tmp, data),
        "tokenizer_json": lambda data: inner(fz.test_tokenizer_json_reader_on_hostile_files)(
            tokjson, tmp, data
        ),
        "scorer": lambda data: inner(fz.test_scorer_reader_on_hostile_files)(tmp, data),
        "checkpoint": lambda data: inner(fc.test_checkpoint_reader_on_hostile_files)(
            saved(), tmp, data
        ),
    }
    for name in names:
        count = collections.Counter()
        t0 = time.time()
        orig = fz.check

        def counting(load, path, fname, orig=orig, count=count, name=name, t0=t0):
            def tracked(p):
                try:
                    out = load(p)
                except (ValueError, FileNotFoundError):
                    count["clear error"] += 1
                    raise
                count["loaded"] += 1
                return out

            orig(tracked, path, fname)
            if sum(count.values()) % 100 == 0:
                print(
                    f"{name}: {dict(count)} after {time.time() - t0:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )

        fz.check = counting
        run = settings(
            max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )(given(data=st.data())(targets[name]))
        try:
            run()
            status = "no failure"
        except Exception as e:  # a falsifying example: hypothesis re-raises it
            subs = getattr(e, "exceptions", [e])
            status = "FAILURE " + " | ".join(f"{type(x).__name__}: {str(x)[:300]}" for x in subs)
        fz.check = orig
        print(
            f"SUMMARY {name}: {sum(count.values())} cases, {dict(count)}, "
            f"{time.time() - t0:.0f} s, {status}",
            flush=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
