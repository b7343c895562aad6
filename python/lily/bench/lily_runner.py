"""lily itself under the throughput contract."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .runners import RunOptions, Timing
from .target import Target


class LilyRunner:
    name = "lily"
    mtp = False  # sessions run the MTP head and generate speculatively with it

    def __init__(self, target: Target, device: str, options: RunOptions):
        from ..model import Model

        if target.random_weights:  # generated in memory: no 19 GB checkpoint to write or read
            self.model = Model.random(str(target.config_path), device, seed=options.seed,
                                      prefill_chunk=options.prefill_chunk, mtp=self.mtp)
        else:
            self.model = Model.load(str(target.checkpoint), device=device, prefill_chunk=options.prefill_chunk,
                                    mtp=self.mtp)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config["vocab_size"])

    def info(self) -> dict:
        from .. import _lily

        engine = self.model._engine
        info = {"device": self.model.device, "weights": engine.source_layout, "weight_bytes": engine.weight_bytes,
                "prefill_chunk": engine.prefill_chunk, "prefill_route": engine.prefill_route,
                "cpu_threads": _lily.num_threads()}
        settings = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("LILY_") and k != "LILY_GIT_COMMIT")
        if settings:
            info["settings"] = settings
        return info

    def run(self, prompt: list[int], new_tokens: int) -> Timing:
        session = self.model.new_session(len(prompt) + new_tokens)
        r = session.generate(prompt, max_tokens=new_tokens, ignore_eos=True, speculative="mtp" if self.mtp else None)
        if len(r.token_ids) != new_tokens:
            raise RuntimeError(f"lily generated {len(r.token_ids)} tokens, expected {new_tokens} ({r.finish_reason})")
        speculation = {"rounds": r.rounds, "draft_tokens": r.draft_tokens, "accepted_tokens": r.accepted_tokens,
                       "round_tokens": r.round_tokens} if self.mtp else None
        return Timing(r.prefill_seconds, r.decode_seconds, r.token_ids, speculation)

    @staticmethod
    def check(device: str) -> dict:
        from .. import _lily, __version__

        check_device(device)
        return {"lily": __version__, "lily_devices": list(_lily.available_devices())}


class LilyMtpRunner(LilyRunner):
    """lily with speculative decoding by the checkpoint's MTP head (draft_tokens "auto"); a
    random-weight target gets a random head, whose drafts are almost never right."""

    name = "lily-mtp"
    mtp = True


def check_device(device: str) -> None:
    """Raises the engine's own error (no CUDA device, an unknown name) unless lily runs on
    `device`: a tiny random model is made there, in milliseconds, before any long load."""
    from .. import _lily, synthetic

    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "config.json"
        config.write_text(json.dumps(synthetic.tiny_config()))
        _lily.Engine.random(str(config), device, 0, 0)
