"""The curated top-level namespace: lazy, complete, and `kvjax.generate` both a package and the
function."""

import subprocess
import sys

import numpy as np
import pytest

import kvjax


def test_every_exported_name_resolves_and_is_documented():
    for name in kvjax.__all__:
        value = getattr(kvjax, name)
        assert value is not None, name
        assert f"`{name}" in kvjax.__doc__, f"{name} is missing from kvjax's docstring table"
    assert set(kvjax.__all__) <= set(dir(kvjax))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = kvjax.nope


def test_fresh_import_is_lazy_and_subpackages_reachable():
    code = (
        "import sys, kvjax\n"
        "assert 'jax' not in sys.modules, 'import kvjax loaded jax'\n"
        "assert kvjax.policies.H2OPolicy(budget=8).budget == 8\n"
        "assert callable(kvjax.generate)\n"
        "import kvjax.generate as kg\n"
        "assert kg is kvjax.generate and kg.generate is not kg\n"
        "print(kvjax.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == kvjax.__version__


def test_generate_callable_package_and_function_agree(tiny_lm):
    import kvjax.generate as kg

    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    gen = kvjax.GenerateConfig(max_new_tokens=4, chunk_size=4)
    policy = kvjax.make_policy("window", 8)
    args = (tiny_lm.config, tiny_lm.params, prompts)
    a = kvjax.generate(*args, policy=policy, gen=gen)
    b = kg.generate(*args, policy=policy, gen=gen)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert kvjax.model_step is kg.model_step and kvjax.new_cache is kg.new_cache


def test_short_policy_names_are_the_registered_classes():
    # Each short name is the class the registry builds under its policy name.
    pairs = {
        "QEvict": "qevict",
        "ConfKV": "confkv",
        "KVpop": "kvpop",
        "H2O": "h2o",
        "Streaming": "streaming",
        "Window": "window",
        "SnapKV": "snapkv",
        "KIVI": "kivi",
    }
    for short, name in pairs.items():
        cls = getattr(kvjax.policies, short)
        assert short in kvjax.policies.__all__
        assert cls is kvjax.policies.POLICIES[name], short
