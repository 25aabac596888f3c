"""OpenAI's chat completions over the completions machinery (runtime/serving/answers.py): the messages become one
prompt through the artifact's chat template, and the answer is a `chat.completion`, or `chat.completion.chunk`
events that open with the assistant's role.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime.decode.logprobs import MAX_TOP, TokenLogprob
from runtime.decode.search import GenerationConfig
from runtime.errors import RequestError
from runtime.serving.answers import (
    ApiError,
    Choice,
    Delta,
    GenerationRequest,
    ServerState,
    finite,
    generation_config,
    refusal,
)

NO_TEMPLATE = (
    "this model's tokenizer has no chat template (tokenizer_config.json `chat_template`); use /v1/completions, "
    "or add a template to the artifact folder's tokenizer_config.json"
)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(GenerationRequest):
    """OpenAI's chat request; `max_completion_tokens` is its name for `max_tokens`, which it still takes.
    Without either, the answer may fill the cache."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP)

    def alternatives(self) -> int | None:
        """How many likeliest alternatives each token's log-probability comes with; None: no log-probabilities."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def chat_prompt(request: ChatRequest, state: ServerState) -> list[int]:
    """The messages as the chat template renders them, up to the assistant's turn, tokenized as a completions
    prompt's text is (the template writes any special tokens it wants). Text parts of a message join with
    newlines, as vLLM joins them for a text-only template."""
    if state.chat_template is None:
        raise ApiError(400, NO_TEMPLATE)
    messages = []
    for message in request.messages:
        content = message.content
        text = content if isinstance(content, str) else "\n".join(part.text for part in content)
        messages.append({**message.model_dump(exclude_none=True), "content": text})
    try:
        rendered = state.chat_template.render(messages)
    except RequestError as refused:
        raise refusal(refused, "messages") from None
    return state.tokenizer.encode(rendered, bos=False)  # a template writes its own BOS


def chat_config(
    request: ChatRequest, prompt: list[int], cache_length: int, stop_tokens: tuple[int, ...]
) -> GenerationConfig:
    """Without a limit asked for, as many tokens as the cache holds after the prompt (the last is never fed); the
    answer also stops at `stop_tokens` (the template's end of turn, `ChatTemplate.stop_tokens`)."""
    asked = request.max_completion_tokens or request.max_tokens
    config = generation_config(request, asked or max(cache_length - len(prompt) + 1, 1))
    return replace(config, stop_tokens=config.stop_tokens + stop_tokens)


class ChatShape:
    """A chat answer's choices: a `message` whole, a `delta` per chunk, log-probabilities as a `content` list."""

    id_prefix, object, chunk_object, prompt_param = "chatcmpl-", "chat.completion", "chat.completion.chunk", "messages"

    def opening(self, choice: Choice) -> dict:
        return {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}  # fmt: skip

    def whole(self, choice: Choice, delta: Delta, tokens: list[int]) -> dict:
        return _choice(choice, delta, tokens, "message", {"role": "assistant", "content": delta.text})

    def chunk(self, choice: Choice, delta: Delta, tokens: list[int] | None) -> dict:
        return _choice(choice, delta, tokens, "delta", {"content": delta.text} if delta.text else {})


def _choice(choice: Choice, delta: Delta, tokens: list[int] | None, key: str, text: dict) -> dict:
    answer = {"index": choice.index, key: text, "logprobs": _logprobs(choice, delta.scored),
              "finish_reason": delta.finish_reason}  # fmt: skip
    if tokens is not None:
        answer["token_ids"] = tokens  # an extension, as on completions: the tokens generated
    return answer


def _logprobs(choice: Choice, scored: list[TokenLogprob]) -> dict | None:
    """OpenAI's chat `logprobs`: each token's text, bytes and log-probability, with its `choice.logprobs`
    likeliest alternatives (the chosen token is listed there only if it is one of them)."""
    if choice.logprobs is None:
        return None
    names = choice.token_texts

    def entry(token: int, logprob: float) -> dict:
        return {"token": names[token], "logprob": finite(logprob), "bytes": list(names[token].encode())}

    return {
        "content": [
            {**entry(e.token, e.logprob), "top_logprobs": [entry(*top) for top in e.top[: choice.logprobs]]}
            for e in scored
        ]
    }
