# One virtual environment in .venv; every target that needs it builds it first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch wheel to install. CPU by default; a CUDA user sets e.g. TORCH=torch==2.13.0 (PyPI's CUDA
# build) or TORCH=/path/to/their/torch-2.13.0-*.whl.
TORCH ?= torch==2.13.0+cpu
STAMP := $(VENV)/.setup-done

# `make export MODEL=... [CACHE=dynamic|static] [DTYPE=fp32|fp16|bf16] [QUANT=int8|int4] [OUT=...] [FORCE=1]`; OUT is a
# folder of ARTIFACTS unless given
MODEL ?= fox-py
CACHE ?= dynamic
DTYPE ?= fp32
QUANT ?=
ARTIFACTS ?= artifacts
OUT ?= $(ARTIFACTS)/$(notdir $(MODEL))-$(CACHE)-$(DTYPE)$(if $(QUANT),-$(QUANT))
EXPORT_FLAGS ?=
# `make generate [PROMPT=...] [GENERATE_FLAGS=...]` runs the artifact `make export` makes (exporting it first if needed)
PROMPT ?= def parse_args(argv):
GENERATE_FLAGS ?= --max-new-tokens 48
EXPORT = $(VENV)/bin/kvg-export "$(MODEL)" --out "$(OUT)" --cache $(CACHE) --dtype $(DTYPE) \
	$(if $(QUANT),--quantize $(QUANT)) $(EXPORT_FLAGS)
# `make serve [MODEL=...] [SERVE_FLAGS="--port 8000 --max-batch 8"]`: kvg-serve over the model's static artifact
# (exported first if missing; continuous batching needs the static cache's rows)
SERVE_FLAGS ?=
# `make lm-eval [MODEL=...] [TASKS=kvg_stdlib] [BACKEND=server|hf|both] [LM_EVAL_FLAGS="--limit 10"]`:
# lm-evaluation-harness against kvg-serve on the model's static artifact (exported first if missing), against
# eager PyTorch on the model (hf), or both
TASKS ?= kvg_stdlib
BACKEND ?= server
LM_EVAL_FLAGS ?=
# `make train PRESET=fox-py [TRAIN_FLAGS="--publish"]` trains a trained preset from nothing, or resumes its run
PRESET ?= fox-py
TRAIN_FLAGS ?=
ARTIFACT ?=
EVAL_FLAGS ?=
# gpu-check runs on a GPU machine with its own Python (GPU_PYTHON, holding CUDA torch; no venv is built), after
# `make gpu-bundle` here has put onnxruntime-gpu and the pinned transformers in .whl (docs/cuda.md: "The CUDA check").
GPU_PYTHON ?= python3
GPU_CHECK_FLAGS ?=

.PHONY: setup test test-matrix test-cluster wheel wheel-check lint format clean export generate serve serve-static lm-eval lm-eval-static train eval gpu-bundle gpu-check bench bench-sizes bench-long bench-serve profile

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[export,dev,bench,serve,ray,lm-eval]"
	$(PY) -m exporters.native.library
	touch $@

test: setup
	$(PY) -m pytest -q -n auto --dist loadfile -m "not cluster and not matrix"

# `make test-matrix`: the export matrices' rows (the option matrix, attention kinds and fp16 across the presets), each
# an artifact exported and held to eager (minutes; .ci/run runs them after `make test`)
test-matrix: setup
	$(PY) -m pytest -q -n auto --dist load -m matrix

# `make test-cluster`: the tests that start a Ray cluster, a local one or two nodes (minutes; .ci/run runs them after
# `make test`)
test-cluster: setup
	$(PY) -m pytest -q -m cluster

# `make wheel`: the sdist and the platform wheel in dist/, the fused operator prebuilt into the wheel for x86-64 and
# x86-64-v3 (docs/install.md)
wheel: setup
	$(PY) -m build --outdir dist .

# `make wheel-check`: builds both again, installs the wheel into fresh environments with no C++ compiler on PATH and
# runs kvg-export, kvg-generate and kvg-serve from a folder outside the checkout (.ci/wheel_check.py; a few minutes)
wheel-check: setup
	$(PY) .ci/wheel_check.py

export: setup
	$(EXPORT) $(if $(FORCE),--force)

$(OUT)/kvg_config.json: | setup
	$(EXPORT)

generate: setup $(OUT)/kvg_config.json
	$(VENV)/bin/kvg-generate "$(OUT)" --prompt "$(PROMPT)" $(GENERATE_FLAGS)

serve:
	$(MAKE) --no-print-directory serve-static CACHE=static

serve-static: setup $(OUT)/kvg_config.json
	$(VENV)/bin/kvg-serve "$(OUT)" $(SERVE_FLAGS)

lm-eval:
	$(MAKE) --no-print-directory lm-eval-static CACHE=static

lm-eval-static: setup $(OUT)/kvg_config.json
	$(VENV)/bin/kvg-lm-eval "$(OUT)" --model "$(MODEL)" --tasks "$(TASKS)" --backend $(BACKEND) $(LM_EVAL_FLAGS)

train: setup
	$(VENV)/bin/kvg-train "$(PRESET)" $(TRAIN_FLAGS)

# `make eval [MODEL=...] [ARTIFACT=...] [EVAL_FLAGS=...]`: held-out perplexity and top-1 agreement, eager against
# the artifact (by default the one `make export` makes, exported first if missing)
eval: setup $(if $(ARTIFACT),,$(OUT)/kvg_config.json)
	$(VENV)/bin/kvg-eval "$(MODEL)" --artifact "$(or $(ARTIFACT),$(OUT))" $(EVAL_FLAGS)

# Eager PyTorch against the runtime, side by side, then speculative decoding against plain decoding (see
# bench/README.md); BENCH_FLAGS e.g. "--runs 3", BENCH_SPECULATIVE_FLAGS e.g. "--runs 5".
bench: setup
	$(PY) bench/run.py $(BENCH_FLAGS)
	$(PY) bench/speculative.py $(BENCH_SPECULATIVE_FLAGS)

# The official sizes end to end: export time and memory, fp32 and int4, and the runtime against onnxruntime-genai
# (bench/README.md); BENCH_SIZES_FLAGS e.g. "--models fox-base fox-pro-760m --runs 3"
bench-sizes: setup
	$(PY) bench/official_sizes.py $(BENCH_SIZES_FLAGS)

# Prompts of 512 to 32768 tokens, runtime against onnxruntime-genai (bench/README.md); BENCH_LONG_FLAGS e.g. "--runs 1"
bench-long: setup
	$(PY) bench/long_context.py $(BENCH_LONG_FLAGS)
	$(PY) bench/kept_keys.py

# kvg-serve under 1, 8 and 32 concurrent clients against the same requests one after another, then two scenarios
# and structured outputs' cost (bench/README.md); BENCH_SERVE_FLAGS e.g. "--runs 1 --clients 8"
bench-serve: setup
	$(PY) bench/serve_load.py $(BENCH_SERVE_FLAGS)
	$(PY) bench/serve_scenarios.py $(BENCH_SCENARIO_FLAGS)
	$(PY) bench/serve_structured.py $(BENCH_STRUCTURED_FLAGS)

# onnxruntime's profiler on a decode: time and nodes per operator type (see bench/README.md); PROFILE_FLAGS e.g.
# "--models fox-py --quantize fp32 int8", "--no-peers"
profile: setup
	$(PY) bench/profile_ops.py $(PROFILE_FLAGS)

gpu-bundle:
	bash bench/gpu_bundle.sh

gpu-check:
	GPU_PYTHON=$(GPU_PYTHON) bash bench/gpu_check.sh $(GPU_CHECK_FLAGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build dist
