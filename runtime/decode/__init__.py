"""Decoding: the Model every loop takes, the Generator's and the engine's loops over it, prefill and the decode
step they share, and each request's search (sampling, log-probabilities, scoring)."""
