"""Quality: held-out perplexity and top-1 agreement of eager against an artifact (`kvg-eval`), its plot, and
lm-evaluation-harness's tasks and command (`kvg-lm-eval`)."""
