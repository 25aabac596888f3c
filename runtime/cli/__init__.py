"""The commands: kvg-generate and kvg-serve."""
