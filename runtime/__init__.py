"""The torch-free onnxruntime runtime that serves kvg-export artifacts."""
