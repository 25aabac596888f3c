#!/usr/bin/env bash
# `make gpu-check` on a machine with an NVIDIA GPU: unpack what `make gpu-bundle` made (if .whl holds it) into a
# scratch folder put first on PYTHONPATH, check that onnxruntime lists CUDA, run the CUDA-marked tests, then
# bench/gpu_check.py, whose table is printed last. GPU_PYTHON: the Python with CUDA torch (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${GPU_PYTHON:-python3}
scratch=${KVG_GPU_SCRATCH:-/tmp/kvg-gpu}
if compgen -G ".whl/kvg-gpu.tar.xz.part-*" > /dev/null && [ ! -d "$scratch/ort" ]; then
    mkdir -p "$scratch" && cat .whl/kvg-gpu.tar.xz.part-* | xz -d | tar -C "$scratch" -xf - || exit 1
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --target "$scratch/site" "$scratch"/wheels/*.whl \
        || exit 1
fi
[ -d "$scratch/ort" ] && export PYTHONPATH="$scratch/ort:$scratch/site:.${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1
"$python" - <<'PY' || exit 1
import torch  # loads CUDA's libraries, which onnxruntime-gpu then finds
import onnxruntime as ort
print(f"onnxruntime {ort.__version__} from {ort.__file__}; providers {ort.get_available_providers()}")
assert "CUDAExecutionProvider" in ort.get_available_providers(), "this onnxruntime has no CUDA provider"
assert torch.cuda.is_available(), "torch sees no GPU"
PY
"$python" -m pytest -q -p no:cacheprovider -m cuda tests 2>&1 | tail -n 25
tests=${PIPESTATUS[0]}
"$python" bench/gpu_check.py "$@"
check=$?
echo "gpu-check: CUDA-marked tests exit $tests, bench/gpu_check.py exit $check"
[ "$tests" -eq 0 ] && [ "$check" -eq 0 ]
