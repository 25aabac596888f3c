"""An artifact's chat template: Hugging Face's Jinja `chat_template`, rendered as transformers renders it, so
that a chat prompt here is the text the model was trained to continue.

The template is `chat_template.jinja` in the artifact folder (where transformers now saves it) or else
tokenizer_config.json's `chat_template`; the exporter copies both from the checkpoint. jinja2 is imported
only when an artifact has one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from runtime.errors import ArtifactError, RequestError

CONFIG_NAME = "tokenizer_config.json"
TEMPLATE_NAME = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # the variables templates read


@dataclass(frozen=True)
class ChatTemplate:
    template: Any  # a compiled jinja2.Template
    tokens: dict[str, str]  # SPECIAL_TOKENS the tokenizer config sets, by name
    # The tokenizer config's eos_token as a token id, where it is one: a template may end the assistant's turn with
    # it (ChatML's <|im_end|>) where the model's own eos ids do not list it; vLLM stops a chat there as well
    stop_tokens: tuple[int, ...] = ()

    @classmethod
    def load(cls, folder: Path, tokenizer) -> ChatTemplate | None:
        """The folder's template, with `tokenizer` (the artifact's) to find its stop token; None when it has none.
        An unreadable config or a template that does not compile is an ArtifactError, so that the server refuses
        to start rather than fail each chat request."""
        path = folder / CONFIG_NAME
        try:
            config = json.loads(path.read_text()) if path.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ArtifactError(f"{path} is not valid JSON ({error})") from None
        template_file = folder / TEMPLATE_NAME
        source = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(source, list):  # transformers' named templates: the one a chat uses is "default"
            source = {entry["name"]: entry["template"] for entry in source}.get("default")
        if not source:
            return None
        tokens = {name: _content(config[name]) for name in SPECIAL_TOKENS if config.get(name)}
        end = tokenizer.token_to_id(tokens["eos_token"]) if "eos_token" in tokens else None
        return cls(_compile(source, folder), tokens, () if end is None else (end,))

    def render(self, messages: list[dict]) -> str:
        """The conversation as the model reads it, ending where the assistant's next turn begins; a RequestError
        with the template's own words when it refuses the messages (raise_exception)."""
        import jinja2

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.tokens)
        except jinja2.TemplateError as error:
            raise RequestError(f"the chat template refused the messages: {error}", "messages") from None


def _content(token: str | dict) -> str:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken's fields."""
    return token["content"] if isinstance(token, dict) else token


def _compile(source: str, folder: Path):
    """The environment transformers compiles chat templates in; its `{% generation %}` blocks, which mark the
    assistant's tokens for training, render their contents alone here."""
    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ArtifactError(
            f"{folder} has a chat template, which needs jinja2: pip install 'kvg-export[serve]'"
        ) from None

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, "jinja2.ext.loopcontrols"])  # fmt: skip
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return environment.from_string(source)
    except jinja2.TemplateError as error:
        raise ArtifactError(f"{folder}: the chat template does not compile: {error}") from None
