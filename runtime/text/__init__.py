"""Text in and out: the artifact's tokenizer and its text rules, streamed text made final token by token, and
chat templates."""
