"""llama.cpp as a peer: libllama driven through llama-cpp-python's ctypes bindings (its
low-level API, so no Python runs per token beyond a few foreign calls), reading a qwen35moe
GGUF of the target's dimensions with random Q4_0 weights (gguf_writer). All layers on the GPU
(none on the CPU device), flash attention on, the whole prompt in one llama_decode call split
into ubatches of LILY_LLAMA_CPP_UBATCH tokens (default 4096, the fastest prefill BENCHMARK.md
measured on the H200), greedy sampling by llama.cpp's own sampler chain on the host.

The bindings come from an installed llama-cpp-python or an unpacked sdist on PYTHONPATH; the
library from the package's lib/ or LLAMA_CPP_LIB_PATH (a llama.cpp build's bin/). The GGUF is
written once per config and seed into lily's cache (~/.cache/lily/gguf, LILY_CACHE) or
LILY_LLAMA_CPP_GGUF_DIR, and read by every arm.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

from .. import hub
from . import gguf_writer
from .runners import RunOptions, Timing
from .target import Target

UBATCH = int(os.environ.get("LILY_LLAMA_CPP_UBATCH", "4096"))
_CTX_ROUND = 256
_GPU = 1  # GGML_BACKEND_DEVICE_TYPE_GPU


class LlamaCppRunner:
    name = "llama.cpp"

    def __init__(self, target: Target, device: str, options: RunOptions):
        if not target.random_weights:
            raise ValueError("the llama.cpp peer runs random-weight targets only (--synthetic): lily's MLX "
                             "checkpoint is not a GGUF")
        self.lib = lib = _bindings()
        lib.llama_backend_init()
        gpus = _gpu_names(lib)
        self.device = _resolve(device, gpus)
        text = target.text_config()
        # Beside lily's other caches, never in a results directory (which may be committed).
        self.gguf = Path(os.environ.get("LILY_LLAMA_CPP_GGUF_DIR") or hub.cache_dir() / "gguf") / (
            f"qwen35moe-random-{gguf_writer.digest(text, options.seed)[:16]}.gguf")
        start = time.perf_counter()
        written = gguf_writer.write_gguf(text, self.gguf, options.seed)
        self.gguf_write_s = time.perf_counter() - start if written else None  # None: an earlier arm wrote it

        params = lib.llama_model_default_params()
        if self.device == "cpu":
            params.n_gpu_layers = 0
            self._no_devices = (ctypes.c_void_p * 1)()  # an empty, NULL-terminated device list: the CPU alone
            params.devices = ctypes.addressof(self._no_devices)
            self.device_name = "cpu"
        else:
            params.n_gpu_layers = -1  # all
            params.split_mode = lib.LLAMA_SPLIT_MODE_NONE
            params.main_gpu = int(self.device.partition(":")[2] or 0)
            self.device_name = gpus[params.main_gpu]
        self.n_gpu_layers = params.n_gpu_layers
        self.model = lib.llama_model_load_from_file(str(self.gguf).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {self.gguf} (its log on stderr says why)")
        self.threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self.ctx = None
        self.sampler = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        lib.llama_sampler_chain_add(self.sampler, lib.llama_sampler_init_greedy())

    @property
    def vocab_size(self) -> int:
        return int(self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(self.model)))

    def _context(self, positions: int) -> None:
        """A context holding at least `positions`, made before any timing starts."""
        lib = self.lib
        if self.ctx and lib.llama_n_ctx(self.ctx) >= positions:
            return
        if self.ctx:
            lib.llama_free(self.ctx)
        p = lib.llama_context_default_params()
        p.n_ctx = -(-positions // _CTX_ROUND) * _CTX_ROUND
        p.n_batch = p.n_ctx  # the whole prompt in one llama_decode call
        p.n_ubatch = min(UBATCH, p.n_batch)
        # Only the last token's logits are read; by default the compute buffer would hold a
        # whole ubatch of them (4 GB at 4096 x 248K).
        p.n_outputs_max = 1
        p.n_seq_max = 1
        p.n_threads = p.n_threads_batch = self.threads
        p.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        p.offload_kqv = p.op_offload = self.device != "cpu"
        self.ctx = lib.llama_init_from_model(self.model, p)
        self.kv_types = (p.type_k, p.type_v)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {p.n_ctx} positions (its log says why)")

    def _decode(self, batch) -> None:
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def run(self, prompt: list[int], new_tokens: int) -> Timing:
        lib = self.lib
        self._context(len(prompt) + new_tokens)
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)  # KV cache and recurrent state
        tokens = (lib.llama_token * len(prompt))(*prompt)
        last = (lib.llama_token * 1)()
        ids, times = [], []
        start = time.perf_counter()
        batch = lib.llama_batch_get_one(tokens, len(prompt))  # logits for its last token only
        for _ in range(new_tokens):
            self._decode(batch)
            last[0] = lib.llama_sampler_sample(self.sampler, self.ctx, -1)  # waits for the logits
            times.append(time.perf_counter())
            ids.append(last[0])
            batch = lib.llama_batch_get_one(last, 1)
        return Timing(times[0] - start, times[-1] - times[0], ids)

    def info(self) -> dict:
        lib = self.lib
        desc = ctypes.create_string_buffer(256)
        lib.llama_model_desc(self.model, desc, len(desc))
        info = {"device": self.device, "device_name": self.device_name, "weights": "random Q4_0 (same dimensions)",
                "quant": {"matrices": "Q4_0", "router, shared-expert gate": "Q8_0", "norms, conv1d, A, dt_bias": "F32"},
                "model": desc.value.decode(), "model_bytes": lib.llama_model_size(self.model),
                "gguf": str(self.gguf), "gguf_write_s": self.gguf_write_s, "n_gpu_layers": self.n_gpu_layers,
                "threads": self.threads, "flash_attention": True, "sampling": "llama.cpp's greedy sampler, on the host"}
        if self.ctx:
            info.update(n_ctx=lib.llama_n_ctx(self.ctx), n_batch=lib.llama_n_batch(self.ctx),
                        n_ubatch=lib.llama_n_ubatch(self.ctx), kv_cache=[_type_name(lib, t) for t in self.kv_types])
        return info

    @staticmethod
    def check(device: str) -> dict:
        lib = _bindings()
        lib.llama_backend_init()
        gpus = _gpu_names(lib)
        _resolve(device, gpus)
        return {"llama.cpp": lib.llama_version().decode(),
                "ggml": _ggml(lib, "ggml_version", ctypes.c_char_p)().decode(),
                "ggml_commit": _ggml(lib, "ggml_commit", ctypes.c_char_p)().decode(),  # "unknown" unless built in git
                "llama_cpp_python": _bindings_version(), "libllama": lib._lib._name, "gpus": gpus,
                "system_info": lib.llama_print_system_info().decode().strip()}


def _bindings():
    """llama-cpp-python's ctypes bindings, llama_cpp.llama_cpp, without the package's
    __init__: that also imports the high-level API, whose dependencies (diskcache, jinja2)
    a bench does not need and a GPU machine may lack."""
    if "llama_cpp" not in sys.modules:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None:
            raise ImportError("llama_cpp is not importable: pip install llama-cpp-python, or put an unpacked "
                              "llama-cpp-python sdist on PYTHONPATH")
        sys.modules["llama_cpp"] = importlib.util.module_from_spec(spec)  # the package, its __init__ not run
    try:
        return importlib.import_module("llama_cpp.llama_cpp")
    except FileNotFoundError as e:
        raise RuntimeError(f"libllama not found ({e}): set LLAMA_CPP_LIB_PATH to the directory that holds "
                           "libllama.so (a llama.cpp build's bin/)") from e
    except (OSError, RuntimeError) as e:  # found, but it or a library it needs does not load
        raise RuntimeError(f"libllama: {e}") from e


def _bindings_version() -> str | None:
    init = Path(sys.modules["llama_cpp"].__file__).read_text()
    match = re.search(r'^__version__\s*=\s*"([^"]+)"', init, re.M)
    return match.group(1) if match else None


def _ggml(lib, name: str, restype, *argtypes):
    """A ggml function from libllama's dependencies (dlsym on libllama's handle searches them too)."""
    f = getattr(lib._lib, name)
    f.restype, f.argtypes = restype, list(argtypes)
    return f


def _gpu_names(lib) -> list[str]:
    get = _ggml(lib, "ggml_backend_dev_get", ctypes.c_void_p, ctypes.c_size_t)
    kind = _ggml(lib, "ggml_backend_dev_type", ctypes.c_int, ctypes.c_void_p)
    describe = _ggml(lib, "ggml_backend_dev_description", ctypes.c_char_p, ctypes.c_void_p)
    devices = [get(i) for i in range(_ggml(lib, "ggml_backend_dev_count", ctypes.c_size_t)())]
    return [describe(d).decode() for d in devices if kind(d) == _GPU]


def _type_name(lib, ggml_type: int) -> str:
    return _ggml(lib, "ggml_type_name", ctypes.c_char_p, ctypes.c_int)(ggml_type).decode()


def _resolve(device: str, gpus: list[str]) -> str:
    """`device` as "cpu" or "cuda:N", or an error naming what this libllama sees."""
    if device == "auto":
        return "cuda:0" if gpus else "cpu"
    if device == "cpu":
        return device
    kind, _, index = device.partition(":")
    if kind != "cuda" or not (index or "0").isdigit():
        raise ValueError(f"device '{device}': the llama.cpp peer runs on cpu or cuda[:N]")
    if int(index or 0) >= len(gpus):
        raise RuntimeError(f"device '{device}': this libllama sees {len(gpus)} GPU(s) {gpus} (a CPU-only build? "
                           "build it with -DGGML_CUDA=ON)")
    return f"cuda:{int(index or 0)}"
