"""Structured outputs: a JSON schema, regex, choice or grammar compiled for the artifact's tokenizer, and
each row's mask of the tokens that may come next."""
