"""`--quantize`: its settings, checked before anything is traced, and the weights quantized through
onnxruntime's quantizer."""
