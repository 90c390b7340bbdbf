# The two commands a newcomer runs: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hotspare-installed
PYTEST_ARGS ?=
# DeepSpeed JIT-builds its CPU ops once per venv; a cache shared with other venvs on the
# machine forces rebuilds and lock waits.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

.PHONY: venv test demo slow faults clean

venv: $(STAMP)

# Rebuilt only when the pins or the package metadata change; a no-op otherwise.
$(STAMP): requirements.txt setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Long matrices excluded from `make test`.
slow: venv
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# The whole fault matrix (every fault kind x phase x target rank, ZeRO 1/2/3 and megatron; hours on
# 2 cores): fault_matrix.json and docs/fault-matrix.md. FAULTS_ARGS narrows it, e.g. 'frameworks=[zero2]'.
FAULTS_ARGS ?=
faults: venv
	$(PY) recipes/fault_matrix.py out=fault_matrix.json docs=docs/fault-matrix.md $(FAULTS_ARGS)
	$(PY) recipes/fault_matrix.py out=fault_matrix_hosts.json docs=docs/fault-matrix-hosts.md hosts=true

# The GPT recipe with one spare per logical node; rank 1 is SIGKILLed before step 150 and
# replaced in place. Prints the recovery's phases and writes timeline.png (see the run dir).
demo: venv
	$(PY) recipes/train_gpt.py parallel.spares_per_node=1 fault.rank=1 fault.step=150

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
