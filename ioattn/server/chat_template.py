"""Chat messages -> prompt text: the model's jinja2 chat template, or a plain one for built-in random models.

The model's template is the one `LoadedModel.chat_template` carries: a checkpoint folder's `tokenizer_config.json`
(as transformers' `apply_chat_template` reads it) or a GGUF file's `tokenizer.chat_template`, with the BOS/EOS
strings it may write. Such a template writes the special tokens itself, so its text is encoded without adding
special tokens again; the plain template writes none, so its text is encoded with them (the byte-level
tokenizer of `tiny` cannot spell them as text). Templates run in jinja2's sandbox: a template is code shipped
with a model.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ioattn.models.loader import ChatTemplateSource, LoadedModel, chat_template_source

PLAIN_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TemplateError(ValueError):
    """The messages cannot be rendered (the template refused them, or a part is not text)."""


def _raise_exception(message: str):
    raise TemplateError(message)


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
    def from_source(cls, source: ChatTemplateSource | None) -> ChatTemplate:
        """A model's template (`LoadedModel.chat_template`); the plain one when the model has none."""
        if source is None:
            return cls.plain()
        return cls(source.template, source.bos_token, source.eos_token)

    @classmethod
    def for_model(cls, model: str | os.PathLike | LoadedModel,
                  template_file: str | os.PathLike | None = None) -> ChatTemplate:
        """The template of a loaded model, or of a preset, GGUF file or checkpoint folder read from its metadata
        alone; `template_file` (a jinja file) replaces the template's text when given."""
        source = model.chat_template if isinstance(model, LoadedModel) else chat_template_source(model)
        if template_file is not None:
            with open(template_file) as f:
                text = f.read()
            source = ChatTemplateSource(text, *((source.bos_token, source.eos_token) if source else ()))
        return cls.from_source(source)

    def token_ids(self, tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The rendered prompt encoded as this template needs (special tokens added only by the plain one)."""
        text = self.render(messages, add_generation_prompt)
        return tokenizer.encode(text, add_special_tokens=self.add_special_tokens)

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
