# plait: one command to set up and run the main job, one to set up and test.
#   make demo   -- install everything, then plan (and run) the built-in default
#   make test   -- install everything, then ruff + the import contract + the whole test suite
PY ?= python3
PIP = $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: setup demo test lint bench

setup:
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test]"

demo: setup
	$(PY) -m plait.cli plan --run

test: setup
	$(PY) -m ruff check plait tests bench
	$(PY) -c "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))"
	$(PY) -m pytest -q -p no:cacheprovider

lint:
	$(PY) -m ruff check plait tests bench
	$(PY) -c "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))"
