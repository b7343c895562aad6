"""The rules of lily's inputs: each parameter's type and range, the error that says so, and
what text must be (valid Unicode).

One table serves the Python API (Session.generate), the command line (argparse types, so
the sampling flags come from here) and the server (its request schema and 400s), so a
value is accepted or refused, with the same words, wherever it is given. Checks that need
the model (the context a checkpoint holds, its vocabulary) are made where the model is.
"""

from __future__ import annotations

import argparse
import math
import numbers
from dataclasses import dataclass

from ._lily import LilyError


class LilyWarning(UserWarning):
    """Input lily accepts but doubts: a config field that looks misspelt, a name that hides a directory."""


INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
_FLOAT32_MAX = 3.4028234663852886e38  # the engine holds sampling values as 32-bit floats


@dataclass(frozen=True)
class Param:
    name: str  # the Python keyword and the request field
    kind: type  # int or float
    low: float | None = None
    high: float | None = None
    help: str = ""
    default: int | float | None = None  # the Python API's and the command line's

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def rule(self) -> str:
        """'an integer in [1, 2147483647]', 'a number >= 0', ..."""
        what = "an integer" if self.kind is int else "a number"
        if self.low is not None and self.high is not None:
            return f"{what} in [{_number(self.low)}, {_number(self.high)}]"
        if self.low is not None:
            return f"{what} >= {_number(self.low)}"
        return what

    def problem(self, value) -> str | None:
        """Why `value` breaks the rule ('must be ..., got ...'), or None when it keeps it."""
        wanted = numbers.Integral if self.kind is int else numbers.Real
        ok = isinstance(value, wanted) and not isinstance(value, bool) and (self.kind is int or math.isfinite(value))
        if ok and (self.low is None or value >= self.low) and (self.high is None or value <= self.high):
            if self.kind is int or abs(value) <= _FLOAT32_MAX:
                return None
            return f"must be {self.rule} that a 32-bit float holds, got {value!r}"
        return f"must be {self.rule}, got {value!r}"

    def check(self, value, name: str | None = None):
        """`value` as an int or float; a LilyError naming the parameter when it breaks the rule."""
        problem = self.problem(value)
        if problem:
            raise LilyError(f"{name or self.name} {problem}")
        return self.kind(value)

    def parse(self, text: str):
        """An argparse type: the flag's text read as this parameter, or a usage error."""
        try:
            value = self.kind(text)
        except ValueError:
            value = text
        problem = self.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(f"must be {self.rule}, got {text!r}")
        return value

    def json_schema(self) -> dict:
        schema = {"type": "integer" if self.kind is int else "number"}
        if self.low is not None:
            schema["minimum"] = self.low
        if self.high is not None:
            schema["maximum"] = self.high
        return schema


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# Sampling: the options of Session.generate, `lily generate`/`chat` and the server alike.
MAX_TOKENS = Param("max_tokens", int, 1, INT32_MAX, "tokens to generate at most", 256)
TEMPERATURE = Param("temperature", float, 0, None, "0 is greedy", 0.0)
TOP_P = Param("top_p", float, 0, 1, "nucleus mass (1: off; 0: only the most likely token)", 1.0)
TOP_K = Param("top_k", int, -1, INT32_MAX, "candidates kept (0 or -1: off)", 0)
MIN_P = Param("min_p", float, 0, 1, "drop tokens below min_p times the top probability (0: off)", 0.0)
REPETITION_PENALTY = Param("repetition_penalty", float, 0.01, 10,
                           "over prompt and output, Hugging Face's rule (1: off)", 1.0)
PRESENCE_PENALTY = Param("presence_penalty", float, -2, 2, "per token present in the output, OpenAI's rule", 0.0)
FREQUENCY_PENALTY = Param("frequency_penalty", float, -2, 2, "per occurrence in the output, OpenAI's rule", 0.0)
SEED = Param("seed", int, 0, UINT64_MAX, "makes sampling reproducible (default: random)")
SAMPLING = (MAX_TOKENS, TEMPERATURE, TOP_P, TOP_K, MIN_P, REPETITION_PENALTY, PRESENCE_PENALTY,
            FREQUENCY_PENALTY, SEED)
MAX_STOP_STRINGS = 16
DRAFT_TOKENS = Param("draft_tokens", int, 1, 3, "MTP drafts a speculative round (a verify step feeds 1 + drafts)")
AUTO_DRAFTS = "auto"  # draft_tokens: each round's count chosen from measured acceptance and costs, up to 3


def speculation(speculative, draft_tokens) -> tuple[int, bool]:
    """generate's speculative / draft_tokens (None: "auto") as (most drafts a round, adaptive);
    (0, False) without speculation. A LilyError names a bad value."""
    if speculative not in (None, "mtp"):
        raise LilyError(f"speculative must be None or 'mtp', got {speculative!r}")
    if not speculative:
        if draft_tokens is not None:
            raise LilyError("draft_tokens needs speculative='mtp'")
        return 0, False
    if draft_tokens is None or draft_tokens == AUTO_DRAFTS:
        return DRAFT_TOKENS.high, True
    if DRAFT_TOKENS.problem(draft_tokens):
        raise LilyError(f"draft_tokens must be {DRAFT_TOKENS.rule} or {AUTO_DRAFTS!r}, got {draft_tokens!r}")
    return draft_tokens, False


def parse_draft_tokens(text: str):
    """The --draft-tokens flag: 'auto' or a count."""
    if text == AUTO_DRAFTS:
        return text
    try:
        return DRAFT_TOKENS.parse(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be {DRAFT_TOKENS.rule} or {AUTO_DRAFTS!r}, got {text!r}") from None

# Loading: Model.load / Model.random, and the flags that reach them.
PREFILL_CHUNK = Param("prefill_chunk", int, 0, INT32_MAX,
                      "tokens per prefill chunk (0: the device's own, 512 on CPU, 4096 on CUDA)", 0)
WEIGHT_SEED = Param("seed", int, 0, UINT64_MAX, "seed of the random weights", 0)
TOKEN_ID = Param("token id", int, 0, INT32_MAX)

# Serving: `lily serve` and `lily chat` flags, and ServerConfig.
CONTEXT = Param("context", int, 1, INT32_MAX, "context tokens per session (default: the model's)")
MAX_TOKENS_LIMIT = Param("max_tokens_limit", int, 1, INT32_MAX,
                         "upper bound on tokens generated per request (default: the context)")
CACHE_MB = Param("cache_mb", int, 0, 2**40, "prefix cache budget in MiB (0: off)")
CACHE_BYTES = Param("cache_bytes", int, 0, None, "prefix cache budget in bytes (0: off)")
MAX_QUEUE = Param("max_queue", int, 0, 2**20, "requests that may wait; more get 503", 32)
STORED_RESPONSES = Param("stored_responses", int, 0, 2**20,
                         "Responses API: the most responses kept for GET and previous_response_id", 1024)
PORT = Param("port", int, 0, 65535, "TCP port (0: any free one)", 8000)


def context_within(value: int, model_context: int, name: str = "context") -> int:
    """A session context checked against the table and the model's own context."""
    value = CONTEXT.check(value, name)
    if value > model_context:
        raise LilyError(f"{name} {value} exceeds the model's context of {model_context} tokens "
                        f"(max_position_embeddings)")
    return value


def sampling_values(**given) -> dict:
    """The sampling keywords checked against the table (None: not given, left as None)."""
    table = {p.name: p for p in SAMPLING}
    return {k: None if v is None else table[k].check(v) for k, v in given.items()}


def stop_strings(stop) -> list[str]:
    """`stop` (a string, a list of them or None) as a list; LilyError unless each is non-empty
    text and there are at most MAX_STOP_STRINGS."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise LilyError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
    for i, s in enumerate(stops):
        check_text(s, f"stop[{i}]" if not isinstance(stop, str) else "stop")
    return stops


def lone_surrogate(value, where: str = "") -> tuple[str, int, str] | None:
    """(where, index, character) of the first lone surrogate in a string, or in the strings,
    keys and values of nested lists and dicts; None when all of it is valid Unicode text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")  # fails exactly on a surrogate with no pair
        except UnicodeEncodeError as e:
            return where, e.start, value[e.start]
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = lone_surrogate(k, where) or lone_surrogate(v, f"{where}.{k}" if where else str(k))
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = lone_surrogate(v, f"{where}[{i}]")
            if found:
                return found
    return None


def surrogate_message(where: str, index: int, ch: str) -> str:
    return (f"{where} holds a lone surrogate (U+{ord(ch):04X}) at character {index}, which is not valid "
            f"Unicode text (half a UTF-16 pair)")


def check_text(value, where: str) -> None:
    """LilyError naming `where` when text (or the strings inside a structure) is not valid Unicode."""
    found = lone_surrogate(value, where)
    if found:
        raise LilyError(surrogate_message(*found))
