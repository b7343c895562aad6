"""Hugging Face transformers as a peer: Qwen3_5MoeForCausalLM at the target's dimensions,
random init (`from_config`), bf16 on CUDA and fp32 on CPU, greedy `generate`. transformers
picks its fastest paths by itself: grouped_mm experts, SDPA attention, and the
flash-linear-attention / causal-conv1d kernels when those packages are installed.
"""

from __future__ import annotations

import time

from .runners import RunOptions, Timing
from .target import Target

_NOT_TEXT_FIELDS = ("quantization", "quantization_config", "model_type", "architectures")


class HfRunner:
    name = "hf"

    def __init__(self, target: Target, device: str, options: RunOptions):
        import torch
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        self.torch = torch
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        text = {k: v for k, v in target.text_config().items() if k not in _NOT_TEXT_FIELDS}
        torch.manual_seed(options.seed)
        with self.device:
            self.model = Qwen3_5MoeForCausalLM._from_config(Qwen3_5MoeTextConfig(**text), dtype=self.dtype).eval()

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def info(self) -> dict:
        cfg = self.model.config
        name = self.torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return {"device": str(self.device), "device_name": name, "dtype": str(self.dtype).removeprefix("torch."),
                "weights": "random init (same dimensions)",
                "attention": getattr(cfg, "_attn_implementation", None),
                "experts": getattr(cfg, "_experts_implementation", None)}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def run(self, prompt: list[int], new_tokens: int) -> Timing:
        torch = self.torch
        ids = torch.tensor([prompt], device=self.device)
        streamer = _TimingStreamer()
        self._sync()
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, streamer=streamer, pad_token_id=0)
        if len(streamer.token_ids) != new_tokens:
            raise RuntimeError(f"transformers generated {len(streamer.token_ids)} tokens, expected {new_tokens}")
        return Timing(streamer.times[0] - start, streamer.times[-1] - streamer.times[0], streamer.token_ids)

    @staticmethod
    def check(device: str) -> dict:
        import importlib.metadata as md

        import torch
        import transformers

        if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
            raise ImportError(f"transformers {transformers.__version__} has no Qwen3_5MoeForCausalLM (needs >= 5.2)")
        where = torch.device(device)
        if where.type == "cuda" and (where.index or 0) >= torch.cuda.device_count():
            raise RuntimeError(f"device '{device}': torch {torch.__version__} sees "
                               f"{torch.cuda.device_count()} CUDA device(s)")

        versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                    "cuda_available": torch.cuda.is_available()}
        for dist in ("flash-linear-attention", "causal-conv1d"):
            try:
                versions[dist] = md.version(dist)
            except md.PackageNotFoundError:
                versions[dist] = None
        return versions


class _TimingStreamer:
    """Records when each generated token id reaches the host (generate's first put is the prompt)."""

    def __init__(self):
        self._prompt_seen = False
        self.token_ids: list[int] = []
        self.times: list[float] = []

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.token_ids.extend(value.reshape(-1).tolist())  # the copy to the host waits for the device
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass
