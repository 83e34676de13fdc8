# trainmech: two commands on a fresh machine.
#   make run    every notebook headless in CPU mode -> results/$(LABEL)/, as many at once as cores
#               and memory allow (JOBS=1: one after another; the results are the same)
#   make test   the whole suite: unit tests, lint, nbval over the committed notebooks, on every core
#               (pytest-xdist; each test file and each notebook stays in one worker; TEST_WORKERS=0: serial)
#   make lab    JupyterLab at the repository root with Task0 open (LAB_ARGS="--port=9999 --no-browser" …)
#   make test-portable   nbval again under a second numeric path (no SIMD kernels, MKL's compatible
#               code path, oneDNN at AVX2): the committed outputs must hold on other CPUs too (CI runs it after make test)
#   make portability     the full numeric-path report -> results/portability/ (maintainers)
#   make gpu-bundle   the wheels the GPU machine lacks (profiles/cuda-bundle.txt) into .whl/, checked
# Each target creates or refreshes .venv by itself (only when pyproject.toml changed).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LABEL  ?= cpu-reference
NBVAL  := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg
JOBS   ?=
TEST_WORKERS ?= auto
# A numeric path other than this machine's default: ATen's scalar kernels, MKL's compatible path, and
# oneDNN capped at AVX2 (on an AMX CPU, torch's 16-bit CPU attention otherwise calls an AVX-512-only
# packing routine that ATen's scalar build lacks; see trainmech/portability.py).
PORTABLE_PATH := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=AVX2
LAB_ROOT ?= $(CURDIR)
LAB_ARGS ?=

.PHONY: run test test-portable portability lab lint venv clean gpu-bundle

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "trainmech needs Python 3.11 or newer")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "Installing trainmech and its dependencies into $(VENV) (the first time takes several minutes: PyTorch alone is large)"
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --progress-bar on -e '.[test,lab]'
	@touch $(STAMP)

run: $(STAMP)
	$(PY) -m trainmech run --mode cpu --label $(LABEL) $(if $(JOBS),--jobs $(JOBS))

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests notebooks $(NBVAL)

test-portable: $(STAMP)
	$(PORTABLE_PATH) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile notebooks $(NBVAL)

portability: $(STAMP)
	$(PY) -m trainmech portability

lint: $(STAMP)
	$(PY) -m trainmech lint
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The browser opens Task0, and so does the printed address; the file browser reaches the whole
# repository (results/, notebooks/reference/). The project's Jupyter settings (.jupyter/: Markdown
# opens rendered, no news or update checks, encrypted kernel connections) join the config path;
# the user's own ~/.jupyter still applies.
lab: $(STAMP)
	JUPYTER_CONFIG_PATH="$(CURDIR)/.jupyter$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}" \
	$(VENV)/bin/jupyter lab --ServerApp.root_dir="$(LAB_ROOT)" --LabApp.default_url=/lab/tree/notebooks/Task0_training_loop.ipynb \
		$(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

# CPython 3.12, Linux x86-64, binary wheels only, no dependencies resolved: the list is complete by itself.
GPU_PLATFORMS := $(foreach n,2_28 2_27 2_26 2_24 2_17 2014 1,--platform $(if $(filter 2014 1,$(n)),manylinux$(n),manylinux_$(n))_x86_64)

gpu-bundle: $(STAMP)
	rm -rf .whl
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -d .whl -r profiles/cuda-bundle.txt
	$(PY) -m trainmech.gpucheck.bundle .whl

clean:
	rm -rf $(VENV) results/.staging-* results/local results/portability-runs
