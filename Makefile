# Two commands: `make run` (set up + train the default tiny policy on CPU) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.reflow-installed
ARGS   ?=

.PHONY: run test install clean

run: $(STAMP)
	$(BIN)/reflow run --config configs/default.toml $(ARGS)

# The floors' direction of dependency (import-linter contracts in pyproject.toml) and pyflakes first, then the suite.
test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/python -m pytest --durations=20 $(ARGS)

install: $(STAMP)

# CPU torch first (a local wheel on this machine kind; unpinned torch would pull the
# CUDA build), then the package with the CPU build of vLLM. vLLM drags torchvision,
# torchaudio and torchcodec builds that do not load with the CPU torch (transformers
# then fails with `operator torchvision::nms does not exist`), so they are removed. Setuptools' notice that an
# editable install maps the package to this folder is expected (the folders are the package): not printed.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install --quiet -e ".[cpu,dev]"
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	touch $(STAMP)

clean:
	rm -rf $(VENV) .cache runs .pytest_cache
