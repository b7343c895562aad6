"""The checkpoint's tokenizer (tokenizer.json through `tokenizers`) and its chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from ._lily import LilyError


class Tokenizer:
    """Encodes and decodes text with the checkpoint's tokenizer.json."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise LilyError(f"{path}: cannot read the tokenizer ({e})") from e
        config = _read_json(directory / "tokenizer_config.json")
        self.chat_template: str | None = config.get("chat_template")
        template_file = directory / "chat_template.jinja"
        if template_file.exists():
            self.chat_template = template_file.read_text()
        elif (directory / "chat_template.json").exists():
            self.chat_template = _read_json(directory / "chat_template.json").get("chat_template")
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self) -> list[bytes]:
        """The bytes each token id stands for (for stop-string matching in C++)."""
        byte_level = _byte_level_decoder() if self._is_byte_level() else None
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        table = []
        for i in range(self.vocab_size):
            piece = self._tok.id_to_token(i)
            if piece is None:
                table.append(b"")
            elif piece in added or byte_level is None:
                table.append(self._tok.decode([i], skip_special_tokens=False).encode("utf-8", "replace"))
            else:
                table.append(bytes(byte_level.get(ch, 0) for ch in piece))
        return table

    def added_token_ids(self) -> list[int]:
        """The added tokens' ids: special ones (<|im_end|>) and markup (<think>, <tool_call>)."""
        return sorted(self._tok.get_added_tokens_decoder())

    def _is_byte_level(self) -> bool:
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        return decoder.get("type") == "ByteLevel"

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


class StreamDecoder:
    """Turns a growing list of token ids into text pieces that never split a UTF-8
    character: text is released only once its bytes decode without a replacement char."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] produced text already released
        self._read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        done = self._tok.decode(self.ids[self._prefix : self._read], self._skip)
        full = self._tok.decode(self.ids[self._prefix :], self._skip)
        if full.endswith("\ufffd") or len(full) <= len(done):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return full[len(done) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        done = self._tok.decode(self.ids[self._prefix : self._read], self._skip)
        full = self._tok.decode(self.ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self.ids)
        return full[len(done) :]


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: each printable stand-in char -> its byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LilyError(f"{path}: invalid JSON ({e})") from e


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
        return value.get("content")
    return value
