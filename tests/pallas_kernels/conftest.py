"""Makes this folder's shared case builder (`decode_cases`) importable by its tests, and gives
them `triton_tuned` (a Tuning for the Triton dense kernel, its traced programs dropped)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))


@pytest.fixture
def triton_tuned(monkeypatch):
    """`use(tuning)`: the Triton dense kernel reads this Tuning from now on. It is read when the
    kernel is traced, so the kernel's compiled programs are dropped on each change and after
    the test (none traced under a test's Tuning serves a later call)."""
    from kvjax.pallas_kernels.decode_attention import _triton

    def use(tuning):
        monkeypatch.setattr(_triton, "tuning_for", lambda: tuning)
        _triton.decode_attention_triton.clear_cache()
        return _triton.decode_attention_triton

    yield use
    _triton.decode_attention_triton.clear_cache()
