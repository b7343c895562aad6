"""`lily chat`: an interactive chat in the terminal, streamed, on one reused session.

Each turn feeds only what the prefix cache does not hold: the previous reply as the chat
template renders it and the new message, never the older history. Prints prefill and decode
speeds. Thinking is shown dimmed, or hidden with --hide-thinking.
Commands: /reset, /trim, /system [TEXT], /help, /exit. Ctrl-C stops a reply and keeps it, or
clears the line at the prompt; a second Ctrl-C there, or Ctrl-D, leaves.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, TextIO

from . import params
from ._lily import LilyError
from .cli import _add_model_args, _add_sampling_args, _add_speculative_args, _add_think_arg, _sampling, _speculative
from .prefix_cache import PrefixCache, reply_start
from .tool_calls import AssistantStream, prompt_opens_reasoning

HELP = """commands:
  /reset          forget the conversation (keeps the system prompt)
  /trim           drop the oldest turns until a reply has room (up to half the context),
                  then send the message that did not fit, if any
  /system [TEXT]  set the system prompt and start over (no TEXT: remove it)
  /help           this text
  /exit           leave (or Ctrl-D, or Ctrl-C twice)"""
FULL_HINT = "/trim drops the oldest turns to make room, /reset starts over"

DIM, RESET = "\x1b[2m", "\x1b[0m"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("chat", help="chat with a model in the terminal")
    _add_model_args(p)
    _add_sampling_args(p, max_tokens=2048)
    _add_think_arg(p)
    _add_speculative_args(p)
    p.add_argument("--hide-thinking", action="store_true", help="do not show the model's thinking")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--context", type=params.CONTEXT.parse, default=None, help=params.CONTEXT.help)
    p.add_argument("--cache-mb", type=params.CACHE_MB.parse, default=1024,
                   help=f"{params.CACHE_MB.help} (default: 1024)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .model import Model

    _speculative(args)  # a bad flag combination, before the model loads
    model = Model.load(args.model, device=args.device, mtp=args.speculative == "mtp")
    chat = Chat(model, args, sys.stdout, sys.stderr)
    print(f"lily chat: {model.path.name} on {model.device}. /help for commands.", file=sys.stderr)
    chat.loop(_read_line)
    return 0


def _read_line() -> str:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    return input("> ")


class ContextFull(Exception):
    """A turn's prompt does not fit the session's context."""


class Chat:
    """The conversation: its messages, the session and cache behind them, and the screen."""

    def __init__(self, model, args: argparse.Namespace, out: TextIO, err: TextIO):
        self.model = model
        self.args = args
        self.out, self.err = out, err
        self.system = args.system
        self.messages: list[dict] = []
        context = model.max_context if args.context is None else params.context_within(args.context, model.max_context)
        self.session = model.new_session(context)
        self.cache = PrefixCache.for_model(model, args.cache_mb << 20)
        self._styled = out.isatty()
        self._stop_text = {i: model.decode([i]) for i in model.eos_token_ids}
        self._reasoning_shown = False  # reasoning printed and not yet followed by content
        self._unsent: str | None = None  # the message that did not fit the context

    def loop(self, read_line: Callable[[], str]) -> None:
        interrupted = False  # the last thing typed was Ctrl-C
        while True:
            try:
                line = read_line().strip()
            except EOFError:
                self.err.write("\n")
                return
            except KeyboardInterrupt:  # clears the line; a second one leaves
                if interrupted:
                    self.err.write("\n")
                    return
                interrupted = True
                self.err.write("\n[Ctrl-C again or Ctrl-D to leave]\n")
                continue
            interrupted = False
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return
                continue
            self.send(line)

    def send(self, text: str) -> None:
        """One turn, reporting (not raising) what stops it."""
        self._unsent = None
        try:
            self.turn(text)
        except ContextFull as e:
            alone = len(self.messages) == 1
            self.messages = self.messages[:-1]
            self._unsent = None if alone else text
            self.err.write(f"[{e}]\n" if alone else f"[{e}: {FULL_HINT}]\n")
        except KeyboardInterrupt:  # outside generation (e.g. during prefill): drop the turn
            self.messages = self.messages[:-1]
            self.err.write("\n[interrupted]\n")
        except LilyError as e:
            self.messages = self.messages[:-1]
            self.err.write(f"[error: {e}]\n")

    def command(self, line: str) -> bool:
        """Runs a /command; False to leave."""
        name, _, rest = line.partition(" ")
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.messages, self._unsent = [], None
            self.err.write("[conversation reset]\n")
        elif name == "/trim":
            self.trim()
        elif name == "/system":
            self.system, self.messages = rest.strip() or None, []
            self.err.write(f"[system prompt {'set' if self.system else 'removed'}; conversation reset]\n")
        else:
            self.err.write(HELP + "\n")
        return True

    def trim(self) -> None:
        """Drops the oldest turns (a user message and the replies to it) until the
        conversation, with the message that did not fit, leaves room for a reply."""
        pending = [{"role": "user", "content": self._unsent}] if self._unsent is not None else []
        context = self.session.max_context
        room = min(self.args.max_tokens, context // 2)
        dropped = 0
        while self.messages and self._size(self.messages + pending) + room > context:
            end = next((i for i, m in enumerate(self.messages[1:], 1) if m["role"] == "user"), len(self.messages))
            self.messages = self.messages[end:]
            dropped += 1
        size = self._size(self.messages + pending) if self.messages or pending else 0
        self.err.write(f"[dropped {dropped} oldest turn{'s' * (dropped != 1)}; the conversation holds "
                       f"{size:,} of {context:,} tokens]\n")
        if pending:
            self.send(self._unsent)

    def _prompt(self, messages: list[dict]) -> str:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return self.model.apply_chat_template(system + messages, enable_thinking=self.args.think)

    def _size(self, messages: list[dict]) -> int:
        return len(self.model.encode(self._prompt(messages)))

    def turn(self, user_text: str) -> None:
        self.messages.append({"role": "user", "content": user_text})
        text = self._prompt(self.messages)
        ids = self.model.encode(text)
        context = self.session.max_context
        if len(ids) > context:
            what = "the conversation" if len(self.messages) > 1 else "this message alone"
            raise ContextFull(f"{what} is {len(ids):,} tokens, more than the context's {context:,}")
        t0 = time.perf_counter()
        cached = self.cache.prefill(self.session, ids, reply_start(self.model, ids))
        prefill_seconds = time.perf_counter() - t0
        options = {**_sampling(self.args), **_speculative(self.args)}
        run = self.session.generate(None, stream=True, **options)
        parser = AssistantStream(in_reasoning=prompt_opens_reasoning(text))
        self._reasoning_shown = False
        content = []
        try:
            for piece in run:
                content.append(self.show(parser.feed(self._without_stop(piece))))
        except KeyboardInterrupt:
            run.cancel()
            for piece in run:  # the tokens already chosen
                content.append(self.show(parser.feed(self._without_stop(piece))))
        content.append(self.show(parser.finish()))
        self.out.write("\n")
        self.out.flush()
        result = run.result
        if result.finish_reason != "cancelled":
            self.cache.store(self.session)
        self.messages.append({"role": "assistant", "content": "".join(content)})
        fed = len(ids) - cached
        self.err.write(
            f"[prefill {fed} new + {cached} cached tokens"
            f"{f' at {fed / prefill_seconds:,.0f} tok/s' if fed and prefill_seconds > 0 else ''}"
            f" | decode {len(result.token_ids)} tokens at {result.decode_tokens_per_s:,.1f} tok/s"
            f" | {result.finish_reason}]\n")
        if len(self.session.tokens) >= context:
            self.err.write(f"[the context is full: {FULL_HINT}]\n")

    def _without_stop(self, piece) -> str:
        if piece.token_ids and piece.token_ids[-1] in self._stop_text:
            return piece.text.removesuffix(self._stop_text[piece.token_ids[-1]])
        return piece.text

    def show(self, delta) -> str:
        """Prints a delta (reasoning dimmed or hidden); returns its content for the history."""
        if delta.reasoning and not self.args.hide_thinking:
            self.out.write(f"{DIM}{delta.reasoning}{RESET}" if self._styled else delta.reasoning)
            self._reasoning_shown = True
        if delta.content:
            if self._reasoning_shown:  # a blank line between thinking and answer
                self.out.write("\n\n")
                self._reasoning_shown = False
            self.out.write(delta.content)
        self.out.flush()
        return delta.content
