# One virtual environment in .venv; every target that needs it builds it first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch wheel to install. CPU by default; a CUDA user sets e.g. TORCH=torch==2.13.0 (PyPI's CUDA
# build) or TORCH=/path/to/their/torch-2.13.0-*.whl.
TORCH ?= torch==2.13.0+cpu
STAMP := $(VENV)/.setup-done

.PHONY: setup test lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[export,dev]"
	touch $@

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
