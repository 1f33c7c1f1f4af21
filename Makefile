# The two commands of the README. Each sets up whatever is missing first.
.PHONY: demo test lint setup

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/kvjax demo

test: setup
	.venv/bin/python -m ruff check .
	.venv/bin/python -m ruff format --check .
	.venv/bin/python -m pytest -q -n 2 --durations=10

lint: setup
	.venv/bin/python -m ruff check .
	.venv/bin/python -m ruff format --check .
