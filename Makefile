# trainmech: two commands on a fresh machine.
#   make run    every notebook headless in CPU mode -> results/$(LABEL)/, as many at once as cores
#               and memory allow (JOBS=1: one after another; the results are the same)
#   make test   the whole suite: unit tests, lint, nbval over the committed notebooks, on every core
#               (pytest-xdist; each test file and each notebook stays in one worker; TEST_WORKERS=0: serial)
#   make lab    JupyterLab on the notebooks
# Each target creates or refreshes .venv by itself (only when pyproject.toml changed).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LABEL  ?= cpu-reference
NBVAL  := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg
JOBS   ?=
TEST_WORKERS ?= auto

.PHONY: run test lab lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "trainmech needs Python 3.11 or newer")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

run: $(STAMP)
	$(PY) -m trainmech run --mode cpu --label $(LABEL) $(if $(JOBS),--jobs $(JOBS))

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests notebooks $(NBVAL)

lint: $(STAMP)
	$(PY) -m trainmech lint

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

clean:
	rm -rf $(VENV) results/.staging-* results/local
