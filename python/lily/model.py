"""Model and Session: the Python face of lily's C++ engine.

A Model holds the weights on one executor (cpu or cuda). A Session holds one
conversation's state (KV cache + Gated DeltaNet state) and continues from it.
Generation runs in C++ with the GIL released; Python only turns tokens into text.
"""

from __future__ import annotations

import json
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from . import _lily, chat, hub, params
from ._lily import LilyError
from .tokenizer import StreamDecoder, Tokenizer

Prompt = str | Sequence[int] | np.ndarray | None
_SMALLEST_TOP_P = 1e-6  # top_p 0 means "the most likely token only"; the sampler wants > 0 (in fp32)


@dataclass(repr=False)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stop_string: str | None = None  # the stop string that ended the text, if one did
    draft_tokens: int = 0     # speculative decoding: drafts the head proposed
    accepted_tokens: int = 0  # and how many of them the model's own choices confirmed
    rounds: int = 0           # verify steps
    round_tokens: int = 0     # tokens the rounds handed out (the rest: a first one chosen from a prompt's
                              # logits, and plain decode steps where adaptive drafting chose none)

    @property
    def draft_acceptance(self) -> float | None:
        """Accepted / drafted (None without speculative decoding)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def tokens_per_round(self) -> float | None:
        return self.round_tokens / self.rounds if self.rounds else None

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1  # the first token's time is part of prefill
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0

    def __repr__(self) -> str:
        prompt = (f", prompt {self.prompt_tokens} tokens at {self.prefill_tokens_per_s:,.0f} tok/s"
                  if self.prompt_tokens else "")
        return (f"<GenerationResult {self.finish_reason}: {len(self.token_ids)} tokens at "
                f"{self.decode_tokens_per_s:,.1f} tok/s{prompt}, text={_preview(self.text)}>")


@dataclass
class Piece:
    """A piece of streamed output: text that never splits a UTF-8 character."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class Model:
    """A loaded checkpoint on one device."""

    def __init__(self, engine: _lily.Engine, directory: Path, tokenizer: Tokenizer | None):
        self._engine = engine
        self.path = directory
        self.tokenizer = tokenizer
        self.config: dict = engine.config
        self.eos_token_ids: list[int] = _eos_ids(directory, self.config, tokenizer)
        for message in engine.config_warnings:
            warnings.warn(message, params.LilyWarning, stacklevel=3)
        if tokenizer is not None:
            engine.set_token_bytes(tokenizer.token_bytes())

    @classmethod
    def load(
        cls,
        path_or_repo: str,
        device: str = "auto",
        *,
        prefill_chunk: int = 0,
        revision: str | None = None,
        mtp: bool = False,
    ) -> "Model":
        """Loads a local checkpoint directory, a built-in name or a Hub repo id.

        device: "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:N", or
        "metal-emulator" (the Metal kernels on the MSL emulator: a slow test device, docs/metal.md).
        prefill_chunk: tokens per prefill chunk (0: the device's default, 512 on CPU and
        4096 on CUDA); memory for activations grows with it, never with the prompt.
        mtp: run the checkpoint's MTP head beside every session (its cache follows each fed
        token), which ``generate(speculative="mtp")`` needs.
        """
        _check_device(device)
        prefill_chunk = params.PREFILL_CHUNK.check(prefill_chunk)
        if not isinstance(mtp, bool):
            raise LilyError(f"mtp must be True or False, got {mtp!r}")
        directory = hub.resolve(path_or_repo, revision)
        engine = _lily.Engine(str(directory), device, prefill_chunk)
        engine.use_mtp = mtp
        tokenizer = Tokenizer(directory) if (directory / "tokenizer.json").exists() else None
        return cls(engine, directory, tokenizer)

    @classmethod
    def random(cls, config_json: str, device: str = "auto", *, seed: int = 0, prefill_chunk: int = 0,
               mtp: bool = False) -> "Model":
        """A model with random 4-bit weights for a config.json (benchmarks at full size
        without a checkpoint file); no tokenizer, so it takes token ids only. mtp: with a random
        MTP head, run beside every session (as Model.load's mtp)."""
        _check_device(device)
        seed, prefill_chunk = params.WEIGHT_SEED.check(seed), params.PREFILL_CHUNK.check(prefill_chunk)
        if not isinstance(mtp, bool):
            raise LilyError(f"mtp must be True or False, got {mtp!r}")
        engine = _lily.Engine.random(str(config_json), device, seed, prefill_chunk, "plain", mtp)
        engine.use_mtp = mtp
        return cls(engine, Path(config_json).parent, None)

    def __repr__(self) -> str:
        c = self.config
        return (f"<lily.Model {self.path.name} on {self.device}: {c['num_hidden_layers']} layers, hidden "
                f"{c['hidden_size']}, {c['num_experts']} experts ({c['num_experts_per_tok']} active), vocab "
                f"{c['vocab_size']:,}, context {self.max_context:,}>")

    @property
    def device(self) -> str:
        return self._engine.device

    @property
    def has_mtp(self) -> bool:
        """Whether the checkpoint carries an MTP head (speculative decoding: load with mtp=True)."""
        return self._engine.has_mtp

    @property
    def mtp(self) -> bool:
        """Whether sessions run the MTP head (loaded with mtp=True): speculative="mtp" needs it."""
        return self._engine.use_mtp

    @property
    def max_context(self) -> int:
        return int(self.config["max_position_embeddings"])

    # -- text <-> tokens ------------------------------------------------------------

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise LilyError(f"{self.path}: this checkpoint has no tokenizer.json; pass token ids instead of text")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise LilyError(f"encode takes text, got {type(text).__name__}")
        params.check_text(text, "text")
        return self._need_tokenizer().encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._need_tokenizer().decode(ids)

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        enable_thinking: bool | None = None,
        add_generation_prompt: bool = True,
        **kwargs,
    ) -> str:
        tok = self._need_tokenizer()
        params.check_text(messages, "messages")
        params.check_text(tools, "tools")
        if not tok.chat_template:
            raise LilyError(f"{self.path}: the tokenizer has no chat template; pass a prompt instead of messages")
        return chat.render(
            tok.chat_template,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            bos_token=tok.bos_token or "",
            eos_token=tok.eos_token or "",
            **kwargs,
        )

    def prompt_ids(
        self,
        prompt: Prompt = None,
        *,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (through the template)."""
        if messages is not None:
            if prompt is not None:
                raise LilyError("pass either prompt or messages, not both")
            return self.encode(self.apply_chat_template(messages, tools=tools, enable_thinking=enable_thinking))
        if prompt is None:
            return []
        if isinstance(prompt, str):
            params.check_text(prompt, "prompt")
            return self.encode(prompt)
        ids = np.asarray(prompt)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise LilyError("prompt must be text or a 1-D sequence of token ids")
        return [int(t) for t in ids]

    # -- running --------------------------------------------------------------------

    def new_session(self, max_context: int | None = None) -> "Session":
        """A fresh session with room for max_context tokens (default: the model's context)."""
        context = self.max_context if max_context is None else params.context_within(
            max_context, self.max_context, "max_context")
        return Session(self, self._engine.new_session(context))

    def logits(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Teacher-forced logits [T, vocab] (float32) of a token sequence, from a fresh state."""
        ids = _as_tokens(token_ids)
        return self.new_session(max(len(ids), 1)).logits(ids)

    def prefill(self, prompt: Prompt = None, *, messages=None, tools=None, enable_thinking=None,
                max_context: int | None = None) -> "Session":
        """A new session with the prompt already processed."""
        s = self.new_session(max_context)
        s.prefill(prompt, messages=messages, tools=tools, enable_thinking=enable_thinking)
        return s

    def generate(self, prompt: Prompt = None, *, messages=None, max_context: int | None = None, **kwargs):
        """Generates from a fresh session; see Session.generate for the parameters."""
        return self.new_session(max_context).generate(prompt, messages=messages, **kwargs)


class Session:
    """One conversation's cached state on the model's device.

    A session has at most one unfinished stream: any other call on the session first closes
    it (as `_Run.close`), so a stream left behind by a break, an exception or Ctrl-C never
    blocks the session.
    """

    def __init__(self, model: Model, handle: _lily.Session):
        self.model = model
        self._handle = handle
        self._stream: weakref.ref[_Run] | None = None

    def __repr__(self) -> str:
        run = self._stream() if self._stream else None
        state = ", streaming" if run is not None and run.result is None else ""
        return (f"<lily.Session of {self.model.path.name} on {self.model.device}: position "
                f"{self.position:,} of {self.max_context:,}{state}>")

    def close_stream(self) -> None:
        """Ends this session's unfinished stream, if any: cancels it and waits for it to stop.
        The session then holds every token the stream generated (see `_Run.close`)."""
        run = self._stream() if self._stream else None
        if run is not None:
            run.close()

    @property
    def max_context(self) -> int:
        """Positions the session may hold."""
        return self._handle.max_context

    @property
    def position(self) -> int:
        """Tokens processed so far (while a stream generates: so far, at most
        STREAM_READ_AHEAD tokens beyond those it handed out)."""
        return self._handle.position

    @property
    def tokens(self) -> list[int]:
        """Every token of the conversation so far, including a generated one not yet fed."""
        t = list(self._handle.tokens)
        if self._handle.pending >= 0:
            t.append(self._handle.pending)
        return t

    @property
    def expert_load(self) -> np.ndarray | None:
        """Tokens routed to each expert so far, [layers, experts] (int64), or None when the
        executor does not count (only the CPU executor does)."""
        load = np.asarray(self._handle.expert_load, dtype=np.int64)
        return load.reshape(int(self.model.config["num_hidden_layers"]), -1) if load.size else None

    def prefill(self, prompt: Prompt = None, *, messages=None, tools=None, enable_thinking=None) -> np.ndarray:
        """Feeds more prompt tokens; returns the logits [vocab] after the last one."""
        ids = self.model.prompt_ids(prompt, messages=messages, tools=tools, enable_thinking=enable_thinking)
        if not ids:
            raise LilyError("prefill: the prompt is empty")
        self.close_stream()
        return self.model._engine.forward(self._handle, _as_tokens(ids), False)

    def logits(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Feeds tokens and returns the logits [T, vocab] at every position (teacher forcing)."""
        ids = _as_tokens(token_ids)
        if ids.size == 0:
            raise LilyError("logits: no tokens given")
        self.close_stream()
        return self.model._engine.forward(self._handle, ids, True)

    def snapshot(self, compact: bool = False) -> "Session":
        """An independent copy of this session's state. compact: room for only the
        positions it holds (K/V memory grows with them), for snapshots that are only
        restored, never continued."""
        self.close_stream()
        capacity = max(len(self.tokens), 1) if compact else 0  # 0: this session's own capacity
        return Session(self.model, self.model._engine.clone(self._handle, capacity))

    def restore(self, snapshot: "Session") -> None:
        """Returns this session to the state of a snapshot."""
        self.close_stream()
        self.model._engine.restore(self._handle, snapshot._handle)

    def generate(
        self,
        prompt: Prompt = None,
        *,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        enable_thinking: bool | None = None,
        max_tokens: int = params.MAX_TOKENS.default,
        temperature: float = params.TEMPERATURE.default,
        top_p: float = params.TOP_P.default,
        top_k: int = params.TOP_K.default,
        min_p: float = params.MIN_P.default,
        repetition_penalty: float = params.REPETITION_PENALTY.default,
        presence_penalty: float = params.PRESENCE_PENALTY.default,
        frequency_penalty: float = params.FREQUENCY_PENALTY.default,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        stream: bool = False,
        speculative: str | None = None,
        draft_tokens: int | str | None = None,
    ) -> GenerationResult | Iterator[Piece]:
        """Continues the conversation: feeds the prompt (if any) and generates.

        temperature 0 is greedy; every parameter's type and range are lily.params' (top_p 0
        keeps only the most likely token, top_k 0 or -1 is off). stop: strings that end
        generation (not included in the text). With stream=True, returns an iterator of Piece;
        its `result` attribute holds the GenerationResult once the iterator is exhausted. A
        stream generates at most STREAM_READ_AHEAD tokens ahead of its reader and pauses
        there, leaving the model free; it resumes, with the same tokens, when read again.
        speculative="mtp": speculative decoding with the checkpoint's MTP head (a model loaded
        with mtp=True), draft_tokens a round: 1-3, or "auto" (the default), which chooses each
        round's count (0-3) from the acceptance and step costs measured so far, so that drafts
        that are rarely right cost little over plain decoding. Greedy gives exactly plain greedy
        decoding's tokens; sampling and penalties give the same distribution by rejection
        sampling (not the same tokens for a seed). The result reports draft_acceptance and
        tokens_per_round.
        """
        drafts, adaptive = params.speculation(speculative, draft_tokens)
        v = params.sampling_values(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, seed=seed)
        stops = params.stop_strings(stop)
        if stops and self.model.tokenizer is None:
            raise LilyError("stop strings need a tokenizer; use stop_token_ids")
        extra_stop_ids = [params.TOKEN_ID.check(t, f"stop_token_ids[{i}]") for i, t in enumerate(stop_token_ids or [])]
        ids = self.model.prompt_ids(prompt, messages=messages, tools=tools, enable_thinking=enable_thinking)
        if not ids and self.position == 0:
            raise LilyError("the prompt is empty and the session holds no tokens to continue from")
        sampling = _lily.SamplingParams()
        sampling.temperature = v["temperature"]
        sampling.top_p = max(v["top_p"], _SMALLEST_TOP_P)
        sampling.top_k = max(v["top_k"], 0)  # -1 and 0 both mean off
        sampling.min_p = v["min_p"]
        sampling.repetition_penalty = v["repetition_penalty"]
        sampling.presence_penalty = v["presence_penalty"]
        sampling.frequency_penalty = v["frequency_penalty"]
        sampling.seed = v["seed"] if v["seed"] is not None else int(np.random.SeedSequence().entropy % (1 << 63))
        if self.model.tokenizer is not None:
            sampling.vocab_limit = min(self.model.tokenizer.vocab_size, int(self.model.config["vocab_size"]))
        _lily.check_sampling(sampling)  # before the prompt touches the session
        stop_ids = ([] if ignore_eos else list(self.model.eos_token_ids)) + extra_stop_ids

        self.close_stream()
        run = _Run(self, ids, v["max_tokens"], sampling, stop_ids, stops, drafts, adaptive)
        self._stream = weakref.ref(run)
        return run if stream else run.collect()


class _Run:
    """One generate call: prefill, then tokens from the C++ stream turned into text.

    Stop tokens end the text without appearing in it; stop strings are matched in C++
    on token bytes (so the session stops exactly there) and cut from the text here.
    Every token id read appears in exactly one Piece; the last Piece carries finish_reason.
    An exception inside the iteration (Ctrl-C included) cancels the generation.
    """

    def __init__(self, session: Session, ids, max_tokens, params, stop_ids, stops, draft_tokens, adaptive_drafts):
        self.session = session
        self.result: GenerationResult | None = None
        engine = session.model._engine
        self._t0 = time.perf_counter()
        if ids:
            engine.forward(session._handle, _as_tokens(ids), False)
        self._prompt_tokens = len(ids)
        self._stream = engine.generate(session._handle, max_tokens, params, stop_ids,
                                       [s.encode("utf-8") for s in stops], draft_tokens,
                                       adaptive_drafts)
        tok = session.model.tokenizer
        self._decoder = StreamDecoder(tok) if tok is not None else None
        self._stop_ids = set(stop_ids)
        self._stops = stops
        self._held = ""  # text held back while it could still be the start of a stop string
        self._matched: str | None = None  # the stop string found: the rest of the text is dropped
        self._text: list[str] = []
        self._ids: list[int] = []
        self._unsent: list[int] = []  # ids not yet handed out in a Piece
        self._first_token_time: float | None = None

    def __repr__(self) -> str:
        stream = self._stream
        state = f"finished ({self.result.finish_reason})" if self.result else "generating"
        n = stream.n_tokens - 1  # the first token's time is part of prefill
        read = len(self._ids)
        speed = f", decoding at {n / stream.decode_seconds:,.1f} tok/s" if n > 0 and stream.decode_seconds > 0 else ""
        return (f"<lily stream {state}: {read} token{'' if read == 1 else 's'} read{speed}, "
                f"text={_preview(''.join(self._text))}>")

    def __iter__(self):
        return self

    def __next__(self) -> Piece:
        if self.result is not None:
            raise StopIteration
        try:
            return self._next_piece()
        except BaseException:
            self._stream.cancel()
            raise

    def _next_piece(self) -> Piece:
        for tok in self._stream:
            if self._first_token_time is None:
                self._first_token_time = time.perf_counter()
            self._ids.append(tok)
            self._unsent.append(tok)
            if self._decoder is None or tok in self._stop_ids or self._matched is not None:
                continue
            text = self._release(self._decoder.push(tok))
            if text:
                return self._piece(text)
        tail = ""
        if self._decoder is not None and self._matched is None:
            tail = self._release(self._decoder.flush(), final=True)
        self._finish("stop" if self._matched is not None else self._stream.finish_reason)
        return self._piece(tail, self.result.finish_reason)

    def _piece(self, text: str, finish_reason: str | None = None) -> Piece:
        ids, self._unsent = self._unsent, []
        return Piece(text, ids, finish_reason)

    def _release(self, new_text: str, final: bool = False) -> str:
        """Appends decoded text, cutting at a stop string; returns what may be shown."""
        if not self._stops:
            self._text.append(new_text)
            return new_text
        buf = self._held + new_text
        hits = [(at, s) for s in self._stops if (at := buf.find(s)) >= 0]
        if hits:
            at, self._matched = min(hits)
            out, self._held = buf[:at], ""
        else:
            keep = 0 if final else max(
                (k for s in self._stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
            out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self._text.append(out)
        return out

    def _finish(self, reason: str) -> None:
        first = self._first_token_time or time.perf_counter()
        self.result = GenerationResult(
            text="".join(self._text),
            token_ids=list(self._stream.tokens),  # what the session holds, even if a read was interrupted
            finish_reason=reason,
            prompt_tokens=self._prompt_tokens,
            prefill_seconds=first - self._t0,
            decode_seconds=self._stream.decode_seconds,
            stop_string=self._matched,
        )
        (self.result.rounds, self.result.draft_tokens, self.result.accepted_tokens,
         self.result.round_tokens) = self._stream.speculation

    def collect(self) -> GenerationResult:
        for _ in self:
            pass
        return self.result

    def cancel(self) -> None:
        """Stops generation at the next token; iteration then hands out the tokens already
        generated and ends with finish_reason "cancelled". Safe from any thread."""
        self._stream.cancel()

    def close(self) -> None:
        """Cancels the generation and ends the iteration. `result` then covers every token
        generated (the session holds them all): those read and at most STREAM_READ_AHEAD
        more that were not."""
        if self.result is None:
            self._stream.cancel()
            self.collect()


def _preview(text: str, limit: int = 60) -> str:
    """repr() of text, its middle elided when long."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[: limit // 2]!r}…{text[-limit // 2 :]!r}"


def _check_device(device) -> None:
    if not isinstance(device, str):
        raise LilyError(f"device must be a string ('auto', 'cpu', 'cuda', 'cuda:N' or 'metal-emulator'), got {device!r}")


def _as_tokens(ids) -> np.ndarray:
    arr = np.ascontiguousarray(np.asarray(ids, dtype=np.int64))
    if arr.ndim != 1:
        raise LilyError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= 2**31):
        raise LilyError("token ids must be non-negative 32-bit integers")
    return arr.astype(np.int32)


def _eos_ids(directory: Path, config: dict, tokenizer: Tokenizer | None) -> list[int]:
    ids = list(config.get("eos_token_ids", []))
    gen = directory / "generation_config.json"
    if gen.exists():
        try:
            value = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise LilyError(f"{gen}: invalid JSON ({e})") from e
        ids += value if isinstance(value, list) else [value] if value is not None else []
    if tokenizer is not None:
        for text in (tokenizer.eos_token, "<|im_end|>", "<|endoftext|>"):
            tid = tokenizer.token_to_id(text) if text else None
            if tid is not None:
                ids.append(tid)
    return sorted({int(i) for i in ids})
