"""Random-weight checkpoints of any Qwen3.5/3.6 MoE size, for tests and benchmarks.

Two layouts (docs/MODEL.md §2-3):
- ``"mlx"``: exactly what mlx-community/Qwen3.6-35B-A3B-4bit holds (``language_model.*`` names,
  ``switch_mlp`` experts, conv1d [C, K, 1], norms with +1 baked in, affine 4-bit weights with
  8-bit router and shared-expert gate, a ``quantization`` block in config.json);
- ``"hf"``: the bf16 layout of Qwen/Qwen3.6-35B-A3B (``model.language_model.*``, fused 3-D
  experts or per-expert tensors, zero-centred norms, conv1d [C, 1, K], top-level lm_head).

Both layouts are drawn from the same random numbers, so the "mlx" checkpoint of a seed is the
4-bit conversion of the "hf" checkpoint of that seed. Writing streams tensor by tensor, so a
35B checkpoint needs little memory; at that size quantized weights are random codes with
scales chosen for the same spread instead of quantized floats. The names, shapes and
quantization come from lily's checkpoint table and the files from its safetensors writer (both
in lily's extension); needs numpy and, when a tokenizer is written, the ``tokenizers`` library;
no torch or MLX.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from . import _lily, quant
from .output import check_empty_dir, check_free_space

_TEMPLATES = Path(__file__).parent / "templates"
_ROW_BLOCK_ELEMENTS = 1 << 22  # float elements generated at a time for 2-D tensors
_RANDOM_CODES_ABOVE = 1 << 30  # parameters; beyond this, quantized weights are random codes

# Special tokens (special: skipped when decoding with skip_special_tokens) and the
# markup tokens Qwen3.6 adds as ordinary added tokens.
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_BPE_VOCAB = 1000  # byte-level BPE size before the added tokens


# ---- tokenizer ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """A byte-level BPE trained on a short built-in English text; deterministic."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    corpus = (_TEMPLATES / "tokenizer_corpus.txt").read_text(encoding="utf-8")
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _MARKUP_TOKENS])
    return tok.to_str()


@functools.lru_cache(maxsize=1)
def _token_ids() -> dict[str, int]:
    added = json.loads(_tokenizer_json())["added_tokens"]
    ids = {t["content"]: t["id"] for t in added}
    ids["size"] = max(ids.values()) + 1
    return ids


def _generation_config() -> dict:
    ids = _token_ids()
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    return {"bos_token_id": pad, "eos_token_id": [eos, pad], "pad_token_id": pad, "do_sample": True,
            "temperature": 1.0, "top_p": 0.95, "top_k": 20}


def _write_tokenizer(out: Path, generation_config: dict) -> None:
    """Writes the tokenizer files and the generation config."""
    ids = _token_ids()
    (out / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    added = {
        str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": t in _SPECIAL_TOKENS}
        for t in _SPECIAL_TOKENS + _MARKUP_TOKENS
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": (_TEMPLATES / "qwen3_chat_template.jinja").read_text(encoding="utf-8"),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "generation_config.json", generation_config)


# ---- configs --------------------------------------------------------------------------------


def _layer_types(n: int) -> list[str]:
    return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]


def _rope_parameters(head_dim: int, partial_rotary_factor: float) -> dict:
    # mrope sections split the rotary frequency slots T/H/W as 11/11/10 does for 32 slots.
    half = int(head_dim * partial_rotary_factor) // 2
    t = -(-half // 3)
    h = -(-(half - t) // 2)
    return {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": partial_rotary_factor,
            "mrope_section": [t, h, half - t - h], "mrope_interleaved": True}


def _text_config(base: dict, overrides: dict) -> dict:
    c = {**base, **overrides}
    if "layer_types" not in overrides:
        c["layer_types"] = _layer_types(c["num_hidden_layers"])
    if "rope_parameters" not in overrides:
        c["rope_parameters"] = _rope_parameters(c["head_dim"], c["partial_rotary_factor"])
    return c


_COMMON = {
    "model_type": "qwen3_5_moe_text",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "attention_bias": False,
    "attn_output_gate": True,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "partial_rotary_factor": 0.25,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "mamba_ssm_dtype": "float32",
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "initializer_range": 0.02,
    "use_cache": True,
}


def tiny_config(**overrides) -> dict:
    """A tiny text_config (hidden 128, 4 layers: 3 Gated DeltaNet + 1 attention, 8 experts top-2).

    Every quantized input dimension is a multiple of 64, and the vocabulary is the synthetic
    tokenizer's rounded up to a multiple of 64. Keyword arguments override fields; layer_types
    and rope_parameters follow num_hidden_layers / head_dim unless given.
    """
    ids = _token_ids()
    base = {
        **_COMMON,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 32,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "vocab_size": -(-ids["size"] // 64) * 64,
        "max_position_embeddings": 262144,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|endoftext|>"],
    }
    return _text_config(base, overrides)


def config_35b(**overrides) -> dict:
    """The text_config of Qwen3.6-35B-A3B (docs/MODEL.md §1)."""
    base = {
        **_COMMON,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "bos_token_id": 248044,
        "eos_token_id": 248044,
    }
    return _text_config(base, overrides)


# ---- the tensors: lily's checkpoint table, values drawn from the HF parameters -----------------


def _table(text: dict, layout: str, mtp: bool = False) -> list[dict]:
    """Every tensor `layout` stores for text_config `text` (lily's checkpoint table; see
    ``_lily.checkpoint_tensors``; with the MTP head's when mtp), sorted by name."""
    return _lily.checkpoint_tensors(json.dumps(text), layout, mtp)


@dataclass(frozen=True)
class _Param:
    """An HF float tensor as drawn: every layout's values come from these."""

    name: str  # the HF name under model.language_model. (lm_head.weight beside it)
    shape: tuple[int, ...]
    init: str  # "normal", "norm" (zero-centred), "gain" (near 1), "dt_bias", "A_log"
    std: float = 0.0  # for "normal"; also the spread random codes imitate


def _source(t: dict) -> _Param:
    """The HF parameter whose values table entry t holds."""
    shape = tuple(t["source_shape"])
    if t["kind"] in ("norm", "gain", "dt_bias", "A_log"):
        return _Param(t["source"], shape, t["kind"])
    # Unit-variance inputs give unit-variance outputs; the embedding is looked up, not applied.
    return _Param(t["source"], shape, "normal", 1.0 if t["kind"] == "embedding" else shape[-1] ** -0.5)


def _blocks(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """How a tensor is generated piece by piece: per expert, in row blocks, or whole."""
    if len(shape) == 3 and shape[1] > 1:  # an expert stack
        return [shape[1:]] * shape[0]
    if len(shape) >= 2:  # a matrix, or conv1d [C, 1, K]
        inner = shape[1:]
        step = max(1, _ROW_BLOCK_ELEMENTS // math.prod(inner))
        return [(min(step, shape[0] - r), *inner) for r in range(0, shape[0], step)]
    return [shape]


def _rng(seed: int, name: str, *more: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), *more])


def _float_block(seed: int, p: _Param, i: int) -> np.ndarray:
    """Block i of parameter p as float32 (bf16 values, except A_log's)."""
    shape = _blocks(p.shape)[i]
    rng = _rng(seed, p.name, i)
    if p.init == "normal":
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(p.std)
    elif p.init == "norm":  # zero-centred: the model multiplies by 1 + w
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05)
    elif p.init == "gain":
        x = 1 + rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05)
    elif p.init == "dt_bias":
        x = rng.uniform(0.5, 1.5, shape).astype(np.float32)
    else:  # A_log: per-head decay rates A in [1, 16]
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    return _round_bf16(x)


# ---- bf16 helpers -----------------------------------------------------------------------------


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounding to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def _round_bf16(x: np.ndarray) -> np.ndarray:
    return (_bf16_bits(x).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _stored(x: np.ndarray, dtype: str) -> np.ndarray:
    return _bf16_bits(x) if dtype == "BF16" else np.ascontiguousarray(x, dtype=np.float32)


# ---- tensors to write -----------------------------------------------------------------------


@dataclass
class _Tensor:
    name: str
    dtype: str  # "BF16", "F32" or "U32"
    shape: tuple[int, ...]
    chunks: Callable[[], Iterator[np.ndarray]]  # arrays whose bytes, in order, are the data

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (2 if self.dtype == "BF16" else 4)


def _float_chunks(seed: int, p: _Param, dtype: str, blocks, rows=slice(None), plus_one=False):
    """The stored values of `rows` of each of p's `blocks`, with 1 added (MLX's norms)."""
    for i in blocks:
        x = _float_block(seed, p, i)[rows]
        if plus_one:  # rounded to bf16 as mlx_lm's sanitize does
            x = _round_bf16(x + np.float32(1))
        yield _stored(x, dtype)


def _quantized_chunks(seed: int, t: dict, p: _Param, blocks, rows, random_codes: bool):
    """One part of a quantized matrix (t["part"]: codes, scales or biases), block by block.

    random_codes: uniform random codes, with scales and biases that give the weights the
    spread (p.std) and zero mean that quantizing p would, at a fraction of the cost.
    """
    part = ("codes", "scales", "biases").index(t["part"])
    bits, group, K = t["bits"], t["group_size"], t["weight_shape"][-1]
    top = (1 << bits) - 1
    code_std = math.sqrt(((top + 1) ** 2 - 1) / 12)  # std of a uniform code in [0, top]
    for i in blocks:
        n = _blocks(tuple(t["weight_shape"]))[i][0]  # rows of block i
        if not random_codes:
            x = quant.quantize(_float_block(seed, p, i)[rows], group, bits)[part]
        elif part == 0:
            x = _rng(seed, t["module"], i, 0).integers(0, 1 << 32, (n, K * bits // 32), dtype=np.uint32)
        else:
            jitter = _rng(seed, t["module"], i, 1).uniform(0.8, 1.2, (n, K // group)).astype(np.float32)
            x = _round_bf16(np.float32(p.std / code_std) * jitter)
            x = x if part == 1 else -x * np.float32(top / 2)
        yield x if part == 0 else _bf16_bits(x)


def _tensor(t: dict, seed: int, random_codes: bool) -> _Tensor:
    """Table entry t, its values drawn from its HF source (an expert's block, some rows of it)."""
    p = _source(t)
    blocks = [t["expert"]] if t["expert"] >= 0 else range(len(_blocks(p.shape)))
    rows = slice(*t["rows"]) if t["rows"] else slice(None)
    if t["part"] == "float":
        chunks = functools.partial(_float_chunks, seed, p, t["dtype"], blocks, rows, t["plus_one"])
    else:
        chunks = functools.partial(_quantized_chunks, seed, t, p, blocks, rows, random_codes)
    return _Tensor(t["name"], t["dtype"], tuple(t["shape"]), chunks)


def _tensors(text: dict, layout: str, seed: int, random_codes: bool = False, mtp: bool = False) -> list[_Tensor]:
    """Every tensor of the checkpoint, sorted by name; random_codes applies to "mlx"."""
    return [_tensor(t, seed, random_codes) for t in _table(text, layout, mtp)]


def _extra_tensors(seed: int, layout: str) -> list[_Tensor]:
    """A few vision-tower tensors, which text-only loaders must skip."""
    vision = _lily.vision_prefix(layout)
    extras = [_Param(vision + "patch_embed.proj.weight", (32, 3 * 2 * 16 * 16), "normal", 0.02),
              _Param(vision + "blocks.0.norm1.weight", (32,), "gain")]
    return [_Tensor(p.name, "BF16", p.shape,
                    functools.partial(_float_chunks, seed, p, "BF16", range(len(_blocks(p.shape)))))
            for p in extras]


# ---- writing ------------------------------------------------------------------------------------

_NUMPY_DTYPES = {"BF16": np.uint16, "F32": np.float32, "U32": np.uint32}


def _write_tensors(out: Path, tensors: list[_Tensor], shard_bytes: int, metadata_format: str) -> None:
    """Writes the tensors through lily's safetensors writer, each generated while it is written."""

    def chunks(i: int):
        dtype = _NUMPY_DTYPES[tensors[i].dtype]
        return (np.ascontiguousarray(chunk, dtype=dtype) for chunk in tensors[i].chunks())

    headers = [(t.name, t.dtype, list(t.shape)) for t in tensors]
    _lily.write_safetensors(str(out), headers, metadata_format, shard_bytes, chunks)


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_checkpoint(
    out_dir,
    config: dict | None = None,
    layout: str = "mlx",
    seed: int = 0,
    tokenizer: bool = True,
    shard_bytes: int | None = None,
    *,
    per_expert: bool = False,
    mtp: bool = False,
    extra_tensors: bool = False,
    random_codes: bool | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes a random-weight checkpoint to out_dir and returns its path.

    config: a text_config dict (default ``tiny_config()``; ``config_35b()`` for full size) or a
    full config holding one under "text_config". layout: "mlx" (4-bit, as mlx-community ships
    it) or "hf" (bf16, as Qwen ships it). tokenizer: also write the synthetic byte-level BPE
    tokenizer, chat template and generation config (the config's token ids follow it).
    shard_bytes: split the weights into files of at most this size (default 5 GiB) with a
    model.safetensors.index.json. per_expert ("hf" only): experts as
    ``mlp.experts.{e}.{gate,up,down}_proj.weight`` instead of fused 3-D tensors.
    mtp: also write the MTP head (MODEL.md §7) in the layout: "mtp.*" in "hf", as Qwen ships it,
    "language_model.mtp.*" in "mlx" (quantized as the trunk's layers are); the trunk's tensors
    are the same as without it.
    extra_tensors: add a few vision-tower tensors that text-only loaders must skip.
    random_codes ("mlx" only): random codes instead of quantized random floats; by default
    only for models above 2^30 parameters. out_dir must not exist or be empty, unless
    overwrite: then the weight files of a checkpoint already there are deleted first (a
    stale shard or index would otherwise be loaded with the new files).
    """
    if layout not in ("mlx", "hf"):
        raise ValueError(f"layout must be 'mlx' or 'hf', got {layout!r}")
    if per_expert and layout != "hf":
        raise ValueError("per_expert applies to layout='hf' only")
    if random_codes and layout != "mlx":
        raise ValueError("random_codes applies to layout='mlx' only")
    config = config or tiny_config()
    text = copy.deepcopy(config.get("text_config", config))
    out = Path(out_dir) if overwrite else check_empty_dir(out_dir, allow="overwrite=True")

    top = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "tie_word_embeddings": text.get("tie_word_embeddings", False), "eos_token_id": text.get("eos_token_id")}
    generation_config = None
    if tokenizer:
        ids = _token_ids()
        if text["vocab_size"] < ids["size"]:
            raise ValueError(
                f"config vocab_size {text['vocab_size']} is smaller than the synthetic tokenizer ({ids['size']})")
        text["bos_token_id"] = text["eos_token_id"] = ids["<|endoftext|>"]
        top.update(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
        generation_config = _generation_config()
    top["text_config"] = text

    if layout == "hf":
        tensors, metadata_format = _tensors(text, "hf_per_expert" if per_expert else "hf", seed, mtp=mtp), "pt"
        config_json = dict(sorted(top.items()))
    else:
        from lily.convert import mlx_config  # the config mlx_lm.convert would write for `top`

        if random_codes is None:
            random_codes = sum(math.prod(t["shape"]) for t in _table(text, "hf")) > _RANDOM_CODES_ABOVE
        tensors, metadata_format = _tensors(text, "mlx", seed, random_codes, mtp), "mlx"
        config_json = mlx_config(top, generation_config, mtp)
    if extra_tensors:
        tensors += _extra_tensors(seed, layout)
    tensors.sort(key=lambda t: t.name)

    # Tensors are generated while written: everything above is checked before a byte is.
    stale = [*out.glob("*.safetensors"), out / "model.safetensors.index.json"] if out.is_dir() else []
    check_free_space(out, sum(t.nbytes for t in tensors), freed=sum(p.stat().st_size for p in stale if p.exists()))
    out.mkdir(parents=True, exist_ok=True)
    for path in stale:
        path.unlink(missing_ok=True)
    if tokenizer:
        _write_tokenizer(out, generation_config)
    _write_tensors(out, tensors, shard_bytes or 5 << 30, metadata_format)
    _write_json(out / "config.json", config_json)
    return out
