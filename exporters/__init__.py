"""Lowering of kvg_export models to ONNX artifacts, validated against eager PyTorch."""
