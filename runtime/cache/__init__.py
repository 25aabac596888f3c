"""The cache on the device: its buffers, the batch-synchronous layout a generation decodes in (DeviceCache), the
per-row layout the engine's requests come and go from (RowCache), forget-gate pruning and recent prompts' prefixes."""
