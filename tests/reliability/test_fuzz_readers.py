"""Hostile files: every reader (GGUF weights and tokenizer, safetensors + config.json, tokenizer
JSON, kvpop scorer files) on truncated files, flipped bytes, huge declared sizes, wrong types
and shapes either loads or raises ONE clear ValueError/FileNotFoundError naming the file — never
another exception, a hang or a large allocation.

CI runs a few examples per reader; KVJAX_FUZZ_EXAMPLES=1000 runs the recorded campaign
(docs/lab/2026-12-01-fuzzing.md)."""

import json
import os
import pathlib
import resource
import shutil
import struct
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvjax.scorers import load_scorer
from kvjax.weights import Tokenizer, load_gguf, load_hf_dir

N = int(os.environ.get("KVJAX_FUZZ_EXAMPLES", "12"))
FUZZ = settings(
    max_examples=N,
    deadline=None,
    derandomize=N <= 50,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
GOLDENS = pathlib.Path(__file__).parents[1] / "goldens"
SCORER = pathlib.Path(__file__).parents[1] / "train" / "data" / "tiny_llama_mlp.msgpack"
MAX_GROWTH_MIB = 512  # a reader may not allocate anything near a declared multi-GB size
MAX_SECONDS = 30


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def mutations(size: int):
    """A file of `size` bytes, mutated: truncated, bytes flipped, or an 8-byte field overwritten
    with a huge or random value (declared lengths, counts, offsets, dims)."""
    at = st.integers(0, max(size - 1, 0))
    return st.one_of(
        st.tuples(st.just("truncate"), st.integers(0, max(size - 1, 0))),
        st.tuples(
            st.just("flip"), st.lists(st.tuples(at, st.integers(1, 255)), min_size=1, max_size=8)
        ),
        st.tuples(
            st.just("huge"),
            st.tuples(at, st.sampled_from([2**64 - 1, 2**63, 2**40, 2**32 - 1, 2**31, 10**12])),
        ),
    )


def mutate(data: bytes, m) -> bytes:
    kind, arg = m
    if kind == "truncate":
        return data[:arg]
    buf = bytearray(data)
    if kind == "flip":
        for i, mask in arg:
            buf[i] ^= mask
    else:
        i, value = arg
        buf[i : i + 8] = struct.pack("<Q", value)[: len(buf) - i]
    return bytes(buf)


def check(load, path: pathlib.Path, name: str) -> None:
    """Loading `path` succeeds or raises one clear error naming `name` (the file)."""
    peak, t0 = _peak_mib(), time.perf_counter()
    try:
        load(path)
    except (ValueError, FileNotFoundError) as e:
        msg = str(e)
        assert name in msg, f"the error does not name the file: {msg}"
        assert len(msg) < 2000, "not one clear line"
    assert time.perf_counter() - t0 < MAX_SECONDS, "hang"
    assert _peak_mib() - peak < MAX_GROWTH_MIB, "large allocation"


# --- GGUF (weights) ------------------------------------------------------------------------


def tiny_gguf_bytes(folder: pathlib.Path) -> bytes:
    from weights.test_gguf import tiny, write_gguf

    hf, config = tiny(GOLDENS / "llama_tiny")
    write_gguf(folder / "tiny.gguf", "llama", hf, config, permute=True)
    return (folder / "tiny.gguf").read_bytes()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    return tiny_gguf_bytes(tmp_path_factory.mktemp("gguf"))


@FUZZ
@given(data=st.data())
def test_gguf_reader_on_hostile_files(tiny_gguf, tmp_path, data):
    m = data.draw(mutations(len(tiny_gguf)))
    path = tmp_path / "hostile.gguf"
    path.write_bytes(mutate(tiny_gguf, m))
    check(load_gguf, path, "hostile.gguf")


# --- GGUF (tokenizer) -----------------------------------------------------------------------


def vocab_gguf_bytes(folder: pathlib.Path) -> bytes:
    from weights.test_tokenizer import write_vocab_gguf

    write_vocab_gguf(folder / "vocab.gguf", "gpt2")
    return (folder / "vocab.gguf").read_bytes()


@pytest.fixture(scope="module")
def vocab_gguf(tmp_path_factory) -> bytes:
    return vocab_gguf_bytes(tmp_path_factory.mktemp("tok"))


@FUZZ
@given(data=st.data())
def test_gguf_tokenizer_reader_on_hostile_files(vocab_gguf, tmp_path, data):
    m = data.draw(mutations(len(vocab_gguf)))
    path = tmp_path / "hostile_vocab.gguf"
    path.write_bytes(mutate(vocab_gguf, m))
    check(Tokenizer.from_gguf, path, "hostile_vocab.gguf")


# --- safetensors + config.json --------------------------------------------------------------


def _hf_copy(tmp_path: pathlib.Path) -> pathlib.Path:
    folder = tmp_path / "hostile_hf"
    if folder.exists():
        shutil.rmtree(folder)
    return shutil.copytree(GOLDENS / "llama_tiny", folder)


@FUZZ
@given(data=st.data())
def test_safetensors_reader_on_hostile_files(tmp_path, data):
    folder = _hf_copy(tmp_path)
    blob = (folder / "model.safetensors").read_bytes()
    # Bias towards the header (its 8-byte length, then JSON): that is where sizes are declared.
    head = struct.unpack("<Q", blob[:8])[0] + 8
    m = data.draw(st.one_of(mutations(head), mutations(len(blob))))
    (folder / "model.safetensors").write_bytes(mutate(blob, m))
    check(load_hf_dir, folder, "model.safetensors")


_BAD_VALUES = [-1, 0, 2**40, 2**63, 1.5, "x", None, [], {}, True, float("nan")]


@FUZZ
@given(data=st.data())
@example(data=None)  # a config.json that is not JSON at all
# Found by the fuzzer (2026-12-01): TypeError/ValueError/AttributeError naming no file.
@example(data='vocab_size="x"')
@example(data="vocab_size=null")
@example(data="vocab_size=[]")
@example(data="rms_norm_eps=null")
@example(data='rms_norm_eps="x"')
@example(data="rope_parameters=-1")
@example(data="num_attention_heads=0;head_dim=0")  # ZeroDivisionError, the 2026-12-01 campaign
def test_config_json_reader_on_hostile_values(tmp_path, data):
    folder = _hf_copy(tmp_path)
    cfg_path = folder / "config.json"
    if data is None:
        cfg_path.write_text("{not json")
    elif isinstance(data, str):  # a recorded failure: key=value;key=value (JSON values)
        cfg = json.loads(cfg_path.read_text())
        for item in data.split(";"):
            key, value = item.split("=")
            cfg[key] = json.loads(value)
        cfg_path.write_text(json.dumps(cfg))
    else:
        cfg = json.loads(cfg_path.read_text())
        keys = data.draw(st.lists(st.sampled_from(sorted(cfg)), min_size=1, max_size=3))
        for k in keys:
            cfg[k] = data.draw(st.sampled_from(_BAD_VALUES))
        if data.draw(st.booleans()):
            cfg["model_type"] = data.draw(st.sampled_from(["bert", "llama", "gpt2", "qwen2", 3]))
        cfg_path.write_text(json.dumps(cfg))
    # A value that disagrees with the weights is reported against the tensor file that shows
    # it; every message names the checkpoint's folder.
    check(load_hf_dir, folder, "hostile_hf")


# --- tokenizer.json -------------------------------------------------------------------------


def tokenizer_json_bytes(folder: pathlib.Path, vocab: bytes) -> bytes:
    (folder / "v.gguf").write_bytes(vocab)
    Tokenizer.from_gguf(folder / "v.gguf").backend.save(str(folder / "tokenizer.json"))
    return (folder / "tokenizer.json").read_bytes()


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory, vocab_gguf) -> bytes:
    return tokenizer_json_bytes(tmp_path_factory.mktemp("tokjson"), vocab_gguf)


@FUZZ
@given(data=st.data())
def test_tokenizer_json_reader_on_hostile_files(tokenizer_json, tmp_path, data):
    folder = tmp_path / "hostile_tok"
    folder.mkdir(exist_ok=True)
    m = data.draw(mutations(len(tokenizer_json)))
    (folder / "tokenizer.json").write_bytes(mutate(tokenizer_json, m))
    config = data.draw(st.sampled_from([None, "{", '{"eos_token": 5}', '{"chat_template": 1}']))
    cfg = folder / "tokenizer_config.json"
    if config is None:
        cfg.unlink(missing_ok=True)
    else:
        cfg.write_text(config)
    check(Tokenizer.from_hf_dir, folder, "hostile_tok")


# --- kvpop scorer files ----------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_scorer_reader_on_hostile_files(tmp_path, data):
    blob = SCORER.read_bytes()
    m = data.draw(mutations(len(blob)))
    path = tmp_path / "hostile_scorer.msgpack"
    path.write_bytes(mutate(blob, m))
    check(load_scorer, path, "hostile_scorer.msgpack")


# --- failures the 2026-12-01 campaign found, kept as explicit cases ---------------------------


def test_gguf_metadata_that_is_not_utf8_names_the_file(tiny_gguf, tmp_path):
    path = tmp_path / "bad_utf8.gguf"
    assert tiny_gguf.count(b"llama") >= 1
    path.write_bytes(tiny_gguf.replace(b"llama", b"\xec\xec\xec\xec\xec", 1))
    with pytest.raises(ValueError, match=r"bad_utf8.gguf is not a valid GGUF file: metadata key"):
        load_gguf(path)


def test_renamed_safetensors_tensor_names_the_shard(tmp_path):
    folder = _hf_copy(tmp_path)
    blob = (folder / "model.safetensors").read_bytes()
    name = b"model.norm.weight"
    assert name in blob
    (folder / "model.safetensors").write_bytes(blob.replace(name, b"model.norm.weighx", 1))
    with pytest.raises(ValueError, match=r"'model.norm.weight' is missing.*model.safetensors"):
        load_hf_dir(folder)


def test_gguf_array_type_flip_is_refused_before_the_reader_allocates(vocab_gguf, tmp_path):
    """Byte 190 of the vocab file is an array's element type (8, string); as 9 (array) the
    reader read a string length as a count of 1.5e12 elements and grew past 1.8 GB (the
    2026-12-01 campaign). The header walk refuses it first."""
    blob = bytearray(vocab_gguf)
    assert blob[190] == 8
    blob[190] = 9
    path = tmp_path / "array_flip.gguf"
    path.write_bytes(bytes(blob))
    peak = _peak_mib()
    with pytest.raises(ValueError, match=r"array_flip.gguf is not a valid GGUF file: .*array of"):
        Tokenizer.from_gguf(path)
    assert _peak_mib() - peak < 64


def test_gguf_merges_outside_the_vocab_name_the_file(vocab_gguf, tmp_path):
    """A vocab whose merges name a token it lacks made `tokenizers` raise a bare Exception
    ("Token `a` out of vocabulary"; the 2026-12-01 campaign)."""
    a = struct.pack("<Q", 1) + b"a"
    assert a in vocab_gguf
    path = tmp_path / "bad_merges.gguf"
    path.write_bytes(vocab_gguf.replace(a, struct.pack("<Q", 1) + b"z", 1))
    with pytest.raises(ValueError, match=r"bad_merges.gguf: corrupt tokenizer"):
        Tokenizer.from_gguf(path)


@pytest.mark.parametrize(
    "config", ['{"eos_token": 5}', '{"chat_template": 1}', '{"eos_token": {"content": 3}}']
)
def test_tokenizer_config_values_of_the_wrong_type_name_the_folder(
    tokenizer_json, tmp_path, config
):
    """tokenizers raised TypeError ("'int' object is not an instance of 'str'"; the 2026-12-01
    campaign) on an eos token given as a number."""
    folder = tmp_path / "bad_tok_cfg"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(tokenizer_json)
    (folder / "tokenizer_config.json").write_text(config)
    with pytest.raises(ValueError, match=r"bad_tok_cfg: a tokenizer/generation config value"):
        Tokenizer.from_hf_dir(folder)


def test_gguf_metadata_modelconfig_refuses_names_the_file(tmp_path):
    """ModelConfig's own checks (heads not a multiple of KV heads, head_dim 0) named no file
    (the 2026-12-01 campaign flipped these counts)."""
    from weights.test_gguf import tiny, write_gguf

    hf, config = tiny(GOLDENS / "llama_tiny")
    config = dict(config, num_attention_heads=5, num_key_value_heads=2)
    path = tmp_path / "bad_heads.gguf"
    write_gguf(path, "llama", hf, config, permute=False)
    with pytest.raises(ValueError, match=r"bad_heads.gguf: invalid model metadata"):
        load_gguf(path)
