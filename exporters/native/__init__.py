"""The fused FoX attention operator (fox_attention.cc, onnxruntime's C API) and its build."""
