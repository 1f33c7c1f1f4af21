"""The optax loop: exact resume from orbax checkpoints, clear errors for bad checkpoints."""

import json
import pathlib

import jax
import numpy as np
import pytest

from kvjax.train import LabelSpec, TrainConfig, batch_indices, build_teacher_data, train_scorer

SPEC = LabelSpec(sinks=1, window=4, k=6)


@pytest.fixture(scope="module")
def data(tiny_llama):
    config, params = tiny_llama
    tokens = np.random.default_rng(0).integers(0, 128, (5, 32)).astype(np.int32)
    return build_teacher_data(config, params, tokens, SPEC)


def _cfg(**kw):
    base = dict(scorer="mlstm", labels=SPEC, steps=6, batch=2, warmup=1, eval_every=2, ckpt_every=2)
    return TrainConfig(**(base | kw))


def test_resume_reproduces_the_trajectory_bit_for_bit(tiny_llama, data, tmp_path):
    config, _ = tiny_llama
    cfg = _cfg()
    straight = train_scorer(cfg, config, data, data)
    first = train_scorer(cfg, config, data, data, ckpt_dir=tmp_path, stop_at=3)
    assert len(first.history) == 3
    resumed = train_scorer(cfg, config, data, data, ckpt_dir=tmp_path)
    assert resumed.history == straight.history  # every loss and gradient norm, exactly
    assert resumed.evals == straight.evals
    jax.tree.map(np.testing.assert_array_equal, resumed.params, straight.params)
    # A finished run resumes to itself without training.
    again = train_scorer(cfg, config, data, data, ckpt_dir=tmp_path)
    assert again.history == straight.history


def test_training_lowers_the_loss(tiny_llama, data):
    config, _ = tiny_llama
    res = train_scorer(_cfg(scorer="mlp", steps=40, warmup=4, lr=1e-2, eval_every=0), config, data)
    losses = [h["loss"] for h in res.history]
    assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5])


def test_mismatched_checkpoint_names_the_field(tiny_llama, data, tmp_path):
    config, _ = tiny_llama
    train_scorer(_cfg(steps=2, ckpt_every=1), config, data, ckpt_dir=tmp_path)
    with pytest.raises(ValueError, match=r"different run \(lr: saved 0.003 vs now 0.01"):
        train_scorer(_cfg(steps=2, lr=1e-2), config, data, ckpt_dir=tmp_path)
    with pytest.raises(ValueError, match="scorer: saved 'mlstm' vs now 'mlp'"):
        train_scorer(_cfg(steps=2, scorer="mlp"), config, data, ckpt_dir=tmp_path)


def _step_dir(root: pathlib.Path) -> pathlib.Path:
    return max((p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def test_corrupt_array_data_is_a_clear_error(tiny_llama, data, tmp_path):
    config, _ = tiny_llama
    train_scorer(_cfg(steps=2), config, data, ckpt_dir=tmp_path)
    files = [p for p in (_step_dir(tmp_path) / "state").rglob("*") if p.is_file()]
    for p in files:
        if "d" in p.relative_to(tmp_path).parts[2:-1]:
            p.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt or unreadable"):
        train_scorer(_cfg(steps=2), config, data, ckpt_dir=tmp_path)


def test_corrupt_metadata_is_a_clear_error(tiny_llama, data, tmp_path):
    config, _ = tiny_llama
    train_scorer(_cfg(steps=2), config, data, ckpt_dir=tmp_path)
    meta = _step_dir(tmp_path) / "meta" / "metadata"
    meta.write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        train_scorer(_cfg(steps=2), config, data, ckpt_dir=tmp_path)
    meta.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="corrupt: its metadata has no config"):
        train_scorer(_cfg(steps=2), config, data, ckpt_dir=tmp_path)


def test_batches_depend_only_on_seed_and_step():
    a = [batch_indices(i, 10, 3, 0).tolist() for i in range(5)]
    assert a == [batch_indices(i, 10, 3, 0).tolist() for i in range(5)]
    assert a != [batch_indices(i, 10, 3, 1).tolist() for i in range(5)]
    with pytest.raises(ValueError, match="larger than the 2 training sequences"):
        batch_indices(0, 2, 3, 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, "steps"),
        ({"lr": 0.0}, "lr"),
        ({"tau": -1.0}, "tau"),
        ({"warmup": 6}, "warmup"),
        ({"eval_every": -1}, "eval_every"),
    ],
)
def test_bad_train_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kwargs)
