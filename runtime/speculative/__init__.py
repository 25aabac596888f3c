"""Speculative decoding: the guessers (prompt lookup, a draft model) whose tokens a step verifies at once."""
