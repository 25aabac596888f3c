"""Speculative decoding: the drafters (prompt lookup, a draft model) whose tokens a step verifies at once."""
