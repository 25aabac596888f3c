#!/usr/bin/env bash
# `make gpu-bundle`, on a machine with pip access: what `make gpu-check` needs on a GPU machine whose image has
# CUDA torch but only the CPU onnxruntime and newer transformers (see docs/cuda.md, "The CUDA check"). Writes
# .whl/kvg-gpu.tar.xz.part-* (58 MB each, to carry one per call): onnxruntime-gpu without its tools and
# transformers folders, and the wheels of the transformers, huggingface-hub, tokenizers and onnx-ir this
# project pins (the image's are other versions).
set -euo pipefail
cd "$(dirname "$0")/.."
pin() { grep "^$1==" constraints.txt; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p .whl "$work/ort" "$work/wheels"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$(pin onnxruntime-gpu)" "$(pin transformers)" "$(pin tokenizers)" "$(pin huggingface-hub)" \
    "$(pin onnx-ir)"
python3 -m zipfile -e .whl/onnxruntime_gpu-*-cp312-*.whl "$work/ort"
rm -rf "$work/ort/onnxruntime/tools" "$work/ort/onnxruntime/transformers"
cp .whl/transformers-*.whl .whl/tokenizers-*.whl .whl/huggingface_hub-*.whl .whl/onnx_ir-*.whl "$work/wheels"
rm -f .whl/kvg-gpu.tar.xz.part-*
tar -C "$work" -cf - ort wheels | xz -9 -T0 | split -b 58M - .whl/kvg-gpu.tar.xz.part-
ls -l .whl/kvg-gpu.tar.xz.part-*
