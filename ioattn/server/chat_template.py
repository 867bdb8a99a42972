"""Chat messages -> prompt text: the checkpoint's jinja2 `chat_template`, or a plain one for built-in models.

A checkpoint's template (from `tokenizer_config.json`, as transformers' `apply_chat_template` reads it) writes
the BOS token itself, so its text is encoded without adding special tokens again; the plain template writes no
special tokens, so its text is encoded with them (the byte-level tokenizer of `tiny` cannot spell them as text).
Templates run in jinja2's sandbox: a template is code shipped with a checkpoint.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

PLAIN_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TemplateError(ValueError):
    """The messages cannot be rendered (the template refused them, or a part is not text)."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _special_token(value) -> str:
    """tokenizer_config.json spells a special token as its text or as {"content": text, ...}."""
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""
    add_special_tokens: bool = False  # when encoding the rendered text

    @classmethod
    def plain(cls) -> ChatTemplate:
        return cls(PLAIN_TEMPLATE, add_special_tokens=True)

    @classmethod
    def for_model(cls, model: str | os.PathLike, template_file: str | os.PathLike | None = None) -> ChatTemplate:
        """The template of a checkpoint folder (or of `template_file`, a jinja file, when given); the plain
        template for presets and checkpoints without one."""
        config = {}
        config_file = os.path.join(model, "tokenizer_config.json")
        if os.path.isdir(model) and os.path.isfile(config_file):
            with open(config_file) as f:
                config = json.load(f)
        source = config.get("chat_template")
        if isinstance(source, list):  # several named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if template_file is not None:
            with open(template_file) as f:
                source = f.read()
        if not source:
            return cls.plain()
        return cls(source, _special_token(config.get("bos_token")), _special_token(config.get("eos_token")))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        messages = [{**message, "content": _text_content(i, message.get("content"))}
                    for i, message in enumerate(messages)]
        try:
            return _compiled(self.source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as error:
            raise TemplateError(f"the chat template failed on these messages: {error}") from error


def _text_content(index: int, content) -> str:
    """OpenAI's content: a string, or a list of parts of which only text parts are supported here."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise TemplateError(f"messages[{index}].content: only text parts are supported, got {part.get('type')!r}")
        texts.append(part["text"])
    return "".join(texts)


_environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_environment.globals["raise_exception"] = _raise_exception
_environment.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
_environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
_templates: dict[str, jinja2.Template] = {}


def _compiled(source: str) -> jinja2.Template:
    if source not in _templates:
        _templates[source] = _environment.from_string(source)
    return _templates[source]
