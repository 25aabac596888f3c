"""What every export is held to: eager PyTorch's record and the parity run against it, the manifest and the
graph's agreement with it, and a quantized artifact's cache checks."""
