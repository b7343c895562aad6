"""Chat templates: the checkpoint's jinja template rendered in a sandbox."""

from __future__ import annotations

import datetime
import json
from functools import lru_cache

from ._lily import LilyError


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import StrictUndefined, TemplateError  # noqa: F401
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise LilyError(f"chat template: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def render(
    template: str,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    **kwargs,
) -> str:
    """Renders messages ([{"role": ..., "content": ...}, ...]) to the prompt text."""
    if not isinstance(messages, list) or not messages:
        raise LilyError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise LilyError(f"messages[{i}] must be a dict with a 'role'")
    context = dict(kwargs)
    if enable_thinking is not None:
        context["enable_thinking"] = enable_thinking
    try:
        return _compile(template).render(
            messages=messages, tools=tools or None, add_generation_prompt=add_generation_prompt, **context
        )
    except LilyError:
        raise
    except Exception as e:  # jinja2 errors
        raise LilyError(f"chat template failed to render: {e}") from e
