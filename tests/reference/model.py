"""The whole model in numpy on an MLX checkpoint's stored values (MODEL.md §4, §7): the trunk's
normed hidden states and the MTP head, composed from the op references of numpy_ops.py. The
plain reference the MTP head is tested against (no lily code computes anything here)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import numpy_ops as ref
from .consistency import read_checkpoint


class ReferenceModel:
    """An MLX-layout checkpoint (lily's names after the model prefix; norms stored as 1 + w)."""

    def __init__(self, directory):
        directory = Path(directory)
        config = json.loads((directory / "config.json").read_text())
        self.c = config.get("text_config", config)
        self.quant = config["quantization"]
        self.t = {self._lily_name(k): v for k, v in read_checkpoint(directory).items()}
        c = self.c
        self.kinds = ["full" if (i + 1) % c["full_attention_interval"] == 0 else "linear"
                      for i in range(c["num_hidden_layers"])]

    @staticmethod
    def _lily_name(name: str) -> str:
        for prefix in ("language_model.model.", "language_model."):
            if name.startswith(prefix):
                return name[len(prefix):]
        return name

    def q(self, module: str):
        """The (codes, scales, biases, group_size, bits) of a quantized module."""
        spec = self.quant.get("language_model.model." + module) or self.quant.get("language_model." + module) \
            or self.quant
        return (self.t[module + ".weight"].array(), self.t[module + ".scales"].array(),
                self.t[module + ".biases"].array(), spec["group_size"], spec["bits"])

    def f(self, name: str) -> np.ndarray:
        return self.t[name].floats()

    def _attn(self, p: str) -> dict:
        return {"q_proj": self.q(p + "self_attn.q_proj"), "k_proj": self.q(p + "self_attn.k_proj"),
                "v_proj": self.q(p + "self_attn.v_proj"), "o_proj": self.q(p + "self_attn.o_proj"),
                "q_norm": self.f(p + "self_attn.q_norm.weight"), "k_norm": self.f(p + "self_attn.k_norm.weight")}

    def _moe(self, p: str) -> dict:
        m = p + "mlp."
        return {"router": self.q(m + "gate"), "gate_proj": self.q(m + "switch_mlp.gate_proj"),
                "up_proj": self.q(m + "switch_mlp.up_proj"), "down_proj": self.q(m + "switch_mlp.down_proj"),
                "shared_gate_proj": self.q(m + "shared_expert.gate_proj"),
                "shared_up_proj": self.q(m + "shared_expert.up_proj"),
                "shared_down_proj": self.q(m + "shared_expert.down_proj"),
                "shared_expert_gate": self.q(m + "shared_expert_gate")}

    def _gdn(self, p: str) -> dict:
        a = p + "linear_attn."
        conv = self.f(a + "conv1d.weight")
        return {"in_proj_qkv": self.q(a + "in_proj_qkv"), "in_proj_z": self.q(a + "in_proj_z"),
                "in_proj_b": self.q(a + "in_proj_b"), "in_proj_a": self.q(a + "in_proj_a"),
                "out_proj": self.q(a + "out_proj"), "conv1d": conv.reshape(conv.shape[0], -1),
                "dt_bias": self.f(a + "dt_bias"), "A_log": self.f(a + "A_log"), "norm": self.f(a + "norm.weight")}

    def _attn_kwargs(self) -> dict:
        c = self.c
        return dict(num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                    partial_rotary_factor=c["partial_rotary_factor"],
                    rope_theta=c.get("rope_parameters", {}).get("rope_theta", c.get("rope_theta")),
                    eps=c["rms_norm_eps"])

    def _decoder_layer(self, h, p: str, mixer, kind: str, state):
        """h += mixer(rmsnorm(h)); h += moe(rmsnorm(h)); returns (h, state)."""
        c, eps = self.c, self.c["rms_norm_eps"]
        x = ref.rmsnorm(h, self.f(p + "input_layernorm.weight"), eps)
        if kind == "linear":
            out, conv, rec = ref.gated_delta_mixer(
                x, mixer, *state, num_key_heads=c["linear_num_key_heads"], num_value_heads=c["linear_num_value_heads"],
                key_head_dim=c["linear_key_head_dim"], value_head_dim=c["linear_value_head_dim"], eps=eps)
            state = (conv, rec)
        else:
            out, k, v = ref.attention_mixer(x, mixer, *state, **self._attn_kwargs())
            state = (k, v)
        h = h + out
        x = ref.rmsnorm(h, self.f(p + "post_attention_layernorm.weight"), eps)
        return h + ref.moe_block(x, self._moe(p), c["num_experts_per_tok"], c.get("norm_topk_prob", True)), state

    def hidden(self, tokens) -> np.ndarray:
        """The trunk's hidden states after the final norm, [T, H], from position 0."""
        c = self.c
        h = ref.embedding(tokens, self.q("embed_tokens")).astype(np.float32)
        for i, kind in enumerate(self.kinds):
            p = f"layers.{i}."
            if kind == "linear":
                conv_dim = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + \
                    c["linear_num_value_heads"] * c["linear_value_head_dim"]
                state = (np.zeros((c["linear_conv_kernel_dim"] - 1, conv_dim), np.float32),
                         np.zeros((c["linear_num_value_heads"], c["linear_key_head_dim"],
                                   c["linear_value_head_dim"]), np.float32))
                h, _ = self._decoder_layer(h, p, self._gdn(p), kind, state)
            else:
                empty = np.zeros((0, c["num_key_value_heads"], c["head_dim"]), np.float32)
                h, _ = self._decoder_layer(h, p, self._attn(p), kind, (empty, empty))
        return ref.rmsnorm(h, self.f("norm.weight"), c["rms_norm_eps"])

    def mtp(self, hidden, next_tokens, cache):
        """The MTP head over rows (hidden [R, H] after the trunk's final norm, the next tokens [R])
        after len(cache[0]) cached positions: (out [R, H] after mtp.norm, the extended cache)."""
        c, p = self.c, "mtp.layers.0."
        weights = {**self._attn(p), **self._moe(p), "embed_tokens": self.q("embed_tokens"), "fc": self.q("mtp.fc"),
                   "pre_fc_norm_embedding": self.f("mtp.pre_fc_norm_embedding.weight"),
                   "pre_fc_norm_hidden": self.f("mtp.pre_fc_norm_hidden.weight"), "norm": self.f("mtp.norm.weight"),
                   "input_layernorm": self.f(p + "input_layernorm.weight"),
                   "post_attention_layernorm": self.f(p + "post_attention_layernorm.weight")}
        out, k, v = ref.mtp_head(hidden, next_tokens, weights, *cache, **self._attn_kwargs(),
                                 top_k=c["num_experts_per_tok"], norm_topk_prob=c.get("norm_topk_prob", True))
        return out, (k, v)

    def logits(self, x) -> np.ndarray:
        head = "embed_tokens" if self.c.get("tie_word_embeddings") else "lm_head"
        return ref.qmatmul(x, self.q(head))
