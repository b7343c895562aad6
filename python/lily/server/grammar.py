"""Grammars for constrained decoding, in llguidance's Lark dialect: a JSON answer following a
JSON Schema, and Qwen's XML tool calls.

A call is written as the chat template writes one (lily/tool_calls.py reads it back):

    <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

A tool with `strict: true` (OpenAI's switch for arguments that match the schema) gets its
declared properties in the schema's order, the required ones always: a parameter of type
"string" is bare text (without the closing tag) or one of its enum, any other value JSON
following the property's schema. Other tools get any parameters with any text.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from contextlib import contextmanager

import llguidance

from .._lily import LilyError
from ..tool_calls import CALL_CLOSE, CALL_OPEN, is_text_type
from .errors import bad_request

# JSON whitespace: spaces and line breaks (a pretty-printer's), at most 40 in one place, so a
# model cannot pad its answer without end.
_WHITESPACE = r"[ \n]{1,40}"
# The call's text around its parts, as the chat template writes it.
_FUNCTION_OPEN, _NAME_CLOSE, _BETWEEN_CALLS = "\n<function=", ">\n", "\n"
_CLOSE_PARAMETER, _CLOSE_FUNCTION = "\n</parameter>\n", "</function>\n"

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


class _Vocabulary:
    """A model's tokenizer as llguidance.TokenizerWrapper reads it."""

    def __init__(self, model):
        tok = model.tokenizer
        rows = int(model.config["vocab_size"])
        table = tok.token_bytes()
        self.tokens = table + [b""] * (rows - len(table))  # padded rows: no text, never allowed
        self.special_token_ids = tok.added_token_ids()  # markers are whole tokens, never spelled as text
        self.eos_token_id = model.eos_token_ids[0]
        self.bos_token_id = None
        self._encode = tok.encode

    def __call__(self, text: bytes) -> list[int]:
        return self._encode(text.decode("utf-8", "replace"))


def grammar_tokenizer(model) -> llguidance.LLTokenizer:
    """The model's vocabulary for llguidance, built on first use (seconds for 248k tokens)."""
    with _tokenizers_lock:
        tok = _tokenizers.get(model)
        if tok is None:
            tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(model)),
                                         n_vocab=int(model.config["vocab_size"]), eos_token=model.eos_token_ids)
            _tokenizers[model] = tok
        return tok


@contextmanager
def panics_as_errors():
    """llguidance's Rust panics (pyo3's PanicException, a BaseException: `except Exception` misses
    it) as LilyError; an odd schema can set one off."""
    try:
        yield
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise LilyError(f"llguidance failed: {e}") from None


def compiled(model, rules: str, param: str) -> str:
    """The grammar of Lark `rules`, checked against the model's tokenizer; a 400 naming the
    request's `param` when llguidance cannot enforce it."""
    try:
        with panics_as_errors():
            grammar = llguidance.LLMatcher.grammar_from_lark(rules)
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, grammar_tokenizer(model))
    except LilyError as e:
        failed, messages = True, [str(e)]
    if failed:  # "at 2(4): failed to compile JSON schema: ...", then the grammar: the first line, less where
        why = re.sub(r"^at \d+\(\d+\): ", "", messages[0].splitlines()[0])
        raise bad_request(f"{param} cannot be enforced: {why}", param)
    return grammar


def json_rule(name: str, schema: dict, strict: bool) -> str:
    """A rule matching JSON that follows `schema`; unless strict, keywords llguidance cannot
    enforce are ignored instead of refused."""
    options = {"whitespace_pattern": _WHITESPACE, "lenient": not strict}
    return f"{name}: %json {json.dumps({**schema, 'x-guidance': options}, ensure_ascii=False)}\n"


def check_tool(model, tool: dict, param: str) -> None:
    """A 400 naming `param` when a strict tool's parameters cannot be enforced: checked as a
    JSON Schema first, so that its call grammar is built from a valid one."""
    if not tool.get("strict"):
        return
    schema = tool.get("parameters") or {}
    compiled(model, "start: arguments\n" + json_rule("arguments", schema, strict=True), param)
    for key in schema.get("properties") or {}:
        if key != key.strip() or ">" in key or "\n" in key:
            raise bad_request(f"{param}: the parameter name {key!r} cannot be written in a call (no '>', "
                              f"line breaks or surrounding spaces)", param)


def calls_rules(name: str, tools: list[dict], parallel: bool = True) -> str:
    """A rule matching one call (or several, one per line, when parallel) of any of `tools`
    (OpenAI function definitions, {"name", "parameters", "strict"}, checked by check_tool)."""
    call, functions = f"{name}_call", [f"{name}_fn{i}" for i in range(len(tools))]
    more = f" ({_literal(_BETWEEN_CALLS)} {call})*" if parallel else ""
    rules = [f"{name}: {call}{more}", f"{call}: {CALL_OPEN} {_literal(_FUNCTION_OPEN)} ({' | '.join(functions)})"]
    for rule, tool in zip(functions, tools):
        named = _literal(tool["name"] + _NAME_CLOSE)
        rules += [f"{rule}: {named} {rule}_arguments", arguments_rules(f"{rule}_arguments", tool)]
    return "\n".join(rules) + "\n"


def arguments_rules(name: str, tool: dict) -> str:
    """A rule matching a call's parameters and its closing tags, after `<function=NAME>\\n`."""
    schema = (tool.get("parameters") or {}) if tool.get("strict") else {}
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    shared = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # what "$ref"s point into
    parts, rules = [], []
    for i, (key, prop) in enumerate(properties.items()):
        rule = f"{name}_{i}"
        parts.append(rule if key in required else f"{rule}?")
        rules += _parameter_rules(rule, key, prop if isinstance(prop, dict) else {}, shared)
    if not properties:
        parts.append(f"{name}_any*")
        rules.append(f'{name}_any: "<parameter=" /[^>\\n]+/ ">\\n" {name}_text')
        rules.append(_text_rule(f"{name}_text"))
    closing = f"{_literal(_CLOSE_FUNCTION)} {CALL_CLOSE}"
    return "\n".join([f"{name}: {' '.join(parts)} {closing}", *rules]) + "\n"


def _parameter_rules(rule: str, key: str, schema: dict, shared: dict) -> list[str]:
    opening = _literal(f"<parameter={key}>\n")
    if not is_text_type(schema.get("type")):
        return [f"{rule}: {opening} {rule}_value {_literal(_CLOSE_PARAMETER)}",
                json_rule(f"{rule}_value", {**schema, **shared}, strict=True).rstrip("\n")]
    choices = [v for v in schema.get("enum", [schema["const"]] if "const" in schema else []) if isinstance(v, str)]
    if choices:
        return [f"{rule}: {opening} ({' | '.join(_literal(v) for v in choices)}) {_literal(_CLOSE_PARAMETER)}"]
    return [f"{rule}: {opening} {rule}_text", _text_rule(f"{rule}_text")]


def _text_rule(rule: str) -> str:
    """Bare text up to the first closing tag, which it includes."""
    return f"{rule}[lazy]: /(?s:.*)\\n<\\/parameter>\\n/"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
