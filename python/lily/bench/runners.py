"""Engines a bench can run, each behind the same small interface (a Runner):

    runner = Runner(target, device, options)   # loads the model
    runner.vocab_size, runner.info()           # what the prompt needs; what to record
    runner.run(prompt_ids, new_tokens)         # -> Timing, greedy, EOS ignored
    Runner.check(device)                       # -> versions; raises if it cannot run on device

Peers are added by writing a module with a Runner and listing it in RUNNERS.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

RUNNERS = {
    "lily": "lily.bench.lily_runner:LilyRunner",
    "lily-mtp": "lily.bench.lily_runner:LilyMtpRunner",  # lily decoding speculatively with its MTP head
    "hf": "lily.bench.hf_runner:HfRunner",  # Hugging Face transformers, random init at the same dims
    "llama.cpp": "lily.bench.llama_cpp_runner:LlamaCppRunner",  # libllama on a random Q4_0 GGUF of the same dims
}
PEERS = tuple(name for name in RUNNERS if name != "lily")


@dataclass
class Timing:
    """One generation: seconds from submitting the prompt to the first token id on the
    host, seconds from then to the last token id on the host, and the token ids."""

    prefill_s: float
    decode_s: float
    token_ids: list[int]
    speculation: dict | None = None  # speculative decoding's rounds, drafts and accepted drafts


@dataclass
class RunOptions:
    seed: int = 0
    prefill_chunk: int = 0


def runner_class(name: str):
    if name not in RUNNERS:
        raise ValueError(f"unknown engine '{name}'; known: {', '.join(RUNNERS)}")
    module, cls = RUNNERS[name].split(":")
    return getattr(importlib.import_module(module), cls)
