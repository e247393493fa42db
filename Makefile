# plait: one command to set up and run the main job, one to set up and test.
#   make demo   -- install everything, then plan (and run) the built-in default and write
#                  demo/report.html, the report page of a recorded run of the chosen plan
#   make test   -- install everything, then ruff + the import contracts + the type checker (mypy,
#                  [tool.mypy] in pyproject.toml) + the test suite (two processes; TEST_WORKERS=0 for one)
#   make frameworks -- also install DeepSpeed and torchtitan (CPU): the export tests then check the
#                  exported configs with their own config code (skipped without them)
#   make browser -- install headless Chromium (Debian package): the report tests then render
#                  `plait report`'s page in it and take a screenshot (skipped without it)
PY ?= python3
PIP = $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: setup demo test lint bench frameworks browser

setup:
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test]"

# The demo's files: the chosen plan, a recorded run of it (with the prediction for this machine,
# --predict), and the report page of that run.
DEMO ?= demo
DEMO_DEFAULTS = $$($(PY) -c "from plait.search import DEFAULT_MODEL as m, DEFAULT_CLUSTER as c; print('--model', m, '--cluster', c)")

demo: setup
	mkdir -p $(DEMO)
	$(PY) -m plait.cli plan --run --out $(DEMO)/plan.json
	$(PY) -m plait.cli run $(DEMO_DEFAULTS) --plan $(DEMO)/plan.json --predict --steps 8 --run-dir $(DEMO)/run > $(DEMO)/run.log
	$(PY) -m plait.cli report $(DEMO)/run --search $(DEMO)/plan.search.json -o $(DEMO)/report.html

# Test processes (pytest-xdist; 0: one process, no workers). Two took the suite from 758 s to 522-537 s
# on 2 cores (2026-12-07). Rendezvous ports are drawn below the kernel's ephemeral range
# (plait.net.ports) and a run whose store lost its port before any worker started starts again
# (plait.runtime.launch), so two processes side by side no longer take each other's ports.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m ruff check plait tests bench
	$(PY) -c "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))"
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --durations=25

lint:
	$(PY) -m ruff check plait tests bench
	$(PY) -c "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))"
	$(PY) -m mypy

frameworks: setup
	$(PIP) torch==2.13.0 deepspeed==0.19.8 torchtitan==0.3.0 triton

browser:
	apt-get update -qq && apt-get install -y -qq chromium
