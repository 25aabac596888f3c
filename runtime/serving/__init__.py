"""kvg-serve: the OpenAI-compatible HTTP API over the engine, its guards, its drain on a shutdown signal, and its
Ray Serve application."""
