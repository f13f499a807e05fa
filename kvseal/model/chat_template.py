"""Rendering a model's own jinja2 chat template the way transformers' `apply_chat_template` does.

Chat templates come from model files and are untrusted code, so they run in jinja2's immutable
sandbox. The environment mirrors transformers' `_compile_jinja_template`: trim_blocks and
lstrip_blocks, the loopcontrols extension, a `{% generation %}` block (rendered as its body), a
non-escaping `tojson` filter, and the `raise_exception` / `strftime_now` globals.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag) as a no-op."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares Extension.tags as a plain set attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's built-in tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a fresh sandboxed environment (one per tokenizer, no global cache)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template does not parse as jinja2 (line {e.lineno}): {e.message}") from e


def _content_text(index: int, content: Any) -> str:
    """A message's content as one string; OpenAI-style lists of text parts are joined with newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"messages[{index}].content[{j}] must be {{'type': 'text', 'text': <str>}}, got {part!r}; "
                    "only text content parts are supported"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(
        f"messages[{index}].content must be a string or a list of text parts, got {type(content).__name__}"
    )


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate chat messages and return fresh dicts whose content is a plain string.

    Raises ValueError naming the first malformed message. Extra keys (name, tool_calls, ...) are
    passed through to the template untouched.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            # ValueError, not TypeError: a malformed request body is a value problem for the API layer.
            raise ValueError(  # noqa: TRY004
                f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a non-empty string 'role', got {role!r}")
        if "content" not in message or message["content"] is None:
            raise ValueError(f"messages[{i}] (role {role!r}) has no 'content'")
        out.append({**message, "content": _content_text(i, message["content"])})
    return out


def render_chat_template(
    template: jinja2.Template,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render already-normalized messages (tools: OpenAI's tool objects, as transformers passes them); template
    errors become ValueError."""
    try:
        return template.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template rejected the messages: {e}") from e
