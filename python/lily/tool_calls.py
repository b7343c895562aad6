"""The assistant's raw output split into reasoning, content and tool calls.

Qwen3.5/3.6 write (docs MODEL.md §6.2):

    reasoning…</think>

    content…<tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

The generation prompt usually opens the `<think>` block itself, so whether the output starts
inside reasoning is decided by the prompt. `AssistantStream` takes text piece by piece (as a
stream decodes it) and hands back what each piece completes; parsing a whole reply is the
same thing fed in one piece, so streamed and non-streamed answers always agree. Nothing the
model wrote is dropped or changed but the markers, with the line breaks the chat template
writes around them: text that is not a well-formed call stays, as written, in the channel
where it appeared (except in a block the server forced open, which is a call whatever the
model wrote in it).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

# The line breaks the chat template writes before and after each marker ("reasoning\n</think>\n\n",
# "content\n\n<tool_call>…</tool_call>\n<tool_call>…"): they are the marker's, so a reply sent
# back through the template is what the model wrote. Any other whitespace is the text's own.
_BREAKS_BEFORE = {THINK_OPEN: 0, THINK_CLOSE: 1, CALL_OPEN: 2, CALL_CLOSE: 0}
_BREAKS_AFTER = {THINK_OPEN: 1, THINK_CLOSE: 2, CALL_OPEN: 0, CALL_CLOSE: 1}

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
# A forced block is a call by construction: closers the model left out are implied.
_FORCED_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_FORCED_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's API carries it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    """What one piece of output completed, by channel."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def extend(self, other: "Delta") -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the prompt leaves a <think> block open, so the reply starts as reasoning."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


def parse_tool_call_block(block: str, tools: list[dict] | None = None) -> list[ToolCall]:
    """The calls inside one `<tool_call>…</tool_call>` block (its inner text).

    Parameter values are JSON-decoded unless the tool's schema says the parameter is a
    string (then the text is kept as is); a value that is not valid JSON stays a string.
    """
    return [_call(fn, _PARAMETER, tools) for fn in _FUNCTION.finditer(block)]


def parse_forced_call_block(block: str, tools: list[dict] | None = None) -> list[ToolCall]:
    """The one call of a block the server opened as `<tool_call>\\n<function=NAME>` (tool_choice
    "required" or a named function): a missing `</function>` or `</parameter>` ends at the
    block's end (a parameter also at the next one), and text outside parameters is ignored."""
    fn = _FORCED_FUNCTION.search(block)
    return [_call(fn, _FORCED_PARAMETER, tools)] if fn else []


def _call(fn: re.Match, parameter: re.Pattern, tools: list[dict] | None) -> ToolCall:
    name = fn.group(1).strip()
    types = _parameter_types(tools, name)
    args = {}
    for p in parameter.finditer(fn.group(2)):
        key = p.group(1).strip()
        args[key] = _convert(_strip_one_newline(p.group(2)), types.get(key))
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def render_tool_call(name: str, arguments: dict) -> str:
    """The checkpoint's text form of one call (what the model writes; used by tests and docs)."""
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
        for k, v in arguments.items()
    )
    return f"{CALL_OPEN}\n<function={name}>\n{params}</function>\n{CALL_CLOSE}"


class _Channel:
    """One output channel's text as written, less the line breaks that belong to a marker: up
    to `after_marker(n)` of them right after one, and the next marker's share right before
    it. Trailing line breaks are held until what follows them says whose they are."""

    def __init__(self):
        self._held = ""  # trailing line breaks not released yet
        self._skip = 0  # line breaks still to drop after a marker

    def after_marker(self, breaks: int) -> None:
        self._skip = breaks

    def write(self, text: str, hold: int) -> str:
        """Appends text; returns what may be shown, holding up to `hold` trailing line breaks."""
        while self._skip and text.startswith("\n"):
            text, self._skip = text[1:], self._skip - 1
        if text:
            self._skip = 0
        text = self._held + text
        keep = min(hold, len(text) - len(text.rstrip("\n")))
        self._held = text[len(text) - keep:]
        return text[: len(text) - keep]

    def before_marker(self, breaks: int) -> tuple[str, str]:
        """A marker follows: (the held line breaks it leaves to the text, those it takes)."""
        held, self._held = self._held, ""
        taken = min(breaks, len(held))
        return held[: len(held) - taken], held[len(held) - taken:]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class AssistantStream:
    """Splits the assistant's text, fed piece by piece, into reasoning, content and tool calls.

    in_reasoning: the reply starts inside a <think> block (see prompt_opens_reasoning).
    parse_tools: recognise <tool_call> blocks (when the request offered tools); tools: their
    OpenAI definitions, used to type parameter values. forced: the server forced the reply's
    one block open, so a closed block is read by parse_forced_call_block.
    """

    def __init__(self, *, in_reasoning: bool = False, parse_tools: bool = False, tools: list[dict] | None = None,
                 forced: bool = False):
        self._state = "reasoning" if in_reasoning else "content"
        self._return_to = self._state  # where a tool call block returns to
        self._parse_tools = parse_tools or forced
        self._tools = tools
        self._parse_closed = parse_forced_call_block if forced else parse_tool_call_block
        self._buf = ""  # text not yet assigned: a possible marker start, or an open call block
        self._channels = {"reasoning": _Channel(), "content": _Channel()}
        self._call_breaks = ""  # the line breaks an open call block took, given back if it is no call
        self.tool_calls: list[ToolCall] = []

    def _markers(self) -> dict[str, str]:
        """Marker -> the state it leads to, for the current state."""
        if self._state == "call":
            return {CALL_CLOSE: self._return_to}
        markers = {THINK_CLOSE: "content"} if self._state == "reasoning" else {THINK_OPEN: "reasoning"}
        if self._parse_tools:
            markers[CALL_OPEN] = "call"
        return markers

    def feed(self, text: str) -> Delta:
        out = Delta()
        self._buf += text
        while True:
            markers = self._markers()
            found = [(self._buf.find(m), m) for m in markers if m in self._buf]
            if not found:
                break
            at, marker = min(found)
            before, self._buf = self._buf[:at], self._buf[at + len(marker):]
            if self._state == "call":
                self._close_call(before, out)
            else:
                self._emit(before, out)
                kept, taken = self._channels[self._state].before_marker(_BREAKS_BEFORE[marker])
                self._put(kept, out)
                if markers[marker] == "call":
                    self._return_to, self._call_breaks = self._state, taken
                else:
                    self._channels[markers[marker]].after_marker(_BREAKS_AFTER[marker])
                self._state = markers[marker]
        if self._state != "call":  # release all but a possible marker start
            keep = _longest_marker_prefix_at_end(self._buf, markers)
            self._emit(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
        return out

    def finish(self) -> Delta:
        """Whatever is still held at the end of the output."""
        out = Delta()
        if self._state == "call":
            self._close_call(self._buf, out, closed=False)
        else:
            self._emit(self._buf, out)
        self._buf = ""
        self._put(self._channels[self._state].flush(), out)
        return out

    def _close_call(self, block: str, out: Delta, closed: bool = True) -> None:
        # An unterminated block (output cut short) still counts if a function is complete.
        self._state = self._return_to
        calls = (self._parse_closed if closed else parse_tool_call_block)(block, self._tools)
        if calls:
            self.tool_calls += calls
            out.tool_calls += calls
            if closed:
                self._channels[self._state].after_marker(_BREAKS_AFTER[CALL_CLOSE])
        else:  # not a call after all: the text stays where and as it appeared
            self._emit(self._call_breaks + CALL_OPEN + block + (CALL_CLOSE if closed else ""), out)

    def _emit(self, text: str, out: Delta) -> None:
        hold = max(_BREAKS_BEFORE[m] for m in self._markers())
        self._put(self._channels[self._state].write(text, hold), out)

    def _put(self, text: str, out: Delta) -> None:
        setattr(out, self._state, getattr(out, self._state) + text)


def parse_assistant_output(text: str, *, in_reasoning: bool = False, parse_tools: bool = False,
                           tools: list[dict] | None = None) -> Delta:
    """The whole reply at once (the same rules as streaming)."""
    stream = AssistantStream(in_reasoning=in_reasoning, parse_tools=parse_tools, tools=tools)
    out = stream.feed(text)
    out.extend(stream.finish())
    return out


def _longest_marker_prefix_at_end(text: str, markers) -> int:
    """Length of the longest end of `text` that could be the start of a marker."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _parameter_types(tools: list[dict] | None, name: str) -> dict[str, object]:
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def is_text_type(schema_type) -> bool:
    """Whether a parameter of this schema type is written as bare text, not as JSON."""
    return schema_type == "string" or schema_type == ["string"]


def _convert(value: str, schema_type) -> object:
    if is_text_type(schema_type):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value
