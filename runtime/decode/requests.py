"""What the engine serves: a request, and the events it sends the request's consumer as it runs (a Prompt when it
echoes, Tokens, then one Finished or Failed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from runtime.decode.logprobs import TokenLogprob
from runtime.decode.search import GenerationConfig


@dataclass(frozen=True)
class Token:
    token: int
    logprob: TokenLogprob | None = None  # when the request asked for log-probabilities


@dataclass(frozen=True)
class Prompt:
    """Sent before any Token to a request that echoes its prompt: the prompt's tokens with their log-probabilities,
    if it asked for them (else None)."""

    logprobs: list[TokenLogprob] | None


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (a stop token), "length" (max_new_tokens, or the deadline) or "cancelled"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    message: str


Event = Prompt | Token | Finished | Failed


@dataclass(eq=False)
class Request:
    prompt: list[int]
    config: GenerationConfig
    emit: Callable[[Event], None]  # called from the engine's thread: Tokens, then one Finished or Failed
    deadline: float | None  # the engine's clock (time.monotonic()) past which the request ends
    logprobs: int | None = None  # alternatives to report with each token's log-probability; None: no log-probabilities
    echo: bool = False  # send a Prompt event first; max_new_tokens may then be 0
    cancelled: bool = False

    @property
    def scores_prompt(self) -> bool:
        """Whether it echoes its prompt with log-probabilities: every position's logits are needed then."""
        return self.echo and self.logprobs is not None

    def cancel(self) -> None:
        """Free the request's row (or queue place) before the next step; it emits nothing more."""
        self.cancelled = True

    def send(self, event: Event) -> bool:
        """Deliver an event; a consumer that raises fails its own request only (it is cancelled: False)."""
        try:
            self.emit(event)
            return True
        except Exception:  # the consumer is gone or broken: its request ends, the others go on
            self.cancel()
            return False
