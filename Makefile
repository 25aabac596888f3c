# One virtual environment in .venv; every target that needs it builds it first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch wheel to install. CPU by default; a CUDA user sets e.g. TORCH=torch==2.13.0 (PyPI's CUDA
# build) or TORCH=/path/to/their/torch-2.13.0-*.whl.
TORCH ?= torch==2.13.0+cpu
STAMP := $(VENV)/.setup-done

# `make export MODEL=... [CACHE=dynamic|static] [DTYPE=fp32|fp16|bf16] [OUT=...] [FORCE=1]`
MODEL ?= fox-tiny
CACHE ?= dynamic
DTYPE ?= fp32
OUT ?= artifacts/$(notdir $(MODEL))-$(CACHE)-$(DTYPE)
EXPORT_FLAGS ?=

.PHONY: setup test lint format clean export

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[export,dev]"
	touch $@

test: setup
	$(PY) -m pytest -q

export: setup
	$(VENV)/bin/kvg-export "$(MODEL)" --out "$(OUT)" --cache $(CACHE) --dtype $(DTYPE) $(if $(FORCE),--force) $(EXPORT_FLAGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
