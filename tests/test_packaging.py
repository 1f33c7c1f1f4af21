"""Packaging: train/ and eval/ install inside kvjax, never as top-level packages."""

import pathlib
import subprocess
import sys
import tomllib
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    # Folders installed under another name: package-dir maps them into the kvjax namespace.
    roots = {"kvjax": "kvjax", "train": "kvjax.train", "eval": "kvjax.eval"}
    roots["pallas_kernels"] = "kvjax.pallas_kernels"
    found = {
        ".".join((name, *p.parent.relative_to(ROOT / folder).parts))
        for folder, name in roots.items()
        for p in (ROOT / folder).rglob("__init__.py")
    }
    # Folders of data files only (no __init__.py) are listed too, with their package-data.
    data = {
        ".".join(("kvjax", *d.relative_to(ROOT / "kvjax").parts))
        for d in (ROOT / "kvjax").rglob("*")
        if d.is_dir() and d.name != "__pycache__" and not (d / "__init__.py").exists()
    }
    assert found | data == listed
    assert data <= set(cfg["package-data"])
    assert cfg["package-dir"] == {
        "kvjax": "kvjax",
        "kvjax.train": "train",
        "kvjax.eval": "eval",
        "kvjax.pallas_kernels": "pallas_kernels",
    }


def test_wheel_has_no_top_level_train_or_eval(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("kvjax-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"kvjax", f"kvjax-{wheel.name.split('-')[1]}.dist-info"}
    assert "kvjax/eval/__init__.py" in names and "kvjax/train/__init__.py" in names
    assert "kvjax/scorers/data/kvpop_mlstm_smollm2_135m.msgpack" in names
    # Installed into a fresh folder, the namespace imports with the current dependencies.
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import kvjax.eval, kvjax.train, "
        "kvjax.cli; import importlib.util as u; "
        "assert kvjax.eval.__file__.startswith(sys.argv[1]); "
        "assert u.find_spec('train') is None and u.find_spec('eval') is None"
    )
    subprocess.run([sys.executable, "-c", code, str(target)], check=True, cwd=tmp_path)


def test_declared_stack_is_used():
    """chex and transformers are runtime dependencies because the library imports them."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    sources = "\n".join(
        p.read_text(encoding="utf-8")
        for folder in ("kvjax", "train", "eval")
        for p in (ROOT / folder).rglob("*.py")
    )
    for name, imports in [("chex", ("import chex",)), ("transformers", ("from transformers",))]:
        if any(d.startswith(name) for d in deps):
            assert any(i in sources for i in imports), f"{name} is declared but never imported"
