"""Training the trained presets (`fox-py`, `fox-pro-py`) from nothing on a CPU: `kvg-train PRESET`."""
