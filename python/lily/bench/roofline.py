"""Rooflines from the loaded config: bytes a decode step must move, FLOPs prefill must do.

Decode (batch 1) is bound by memory: per token it reads every weight it uses once, the
Gated DeltaNet state (read and written back), the whole KV cache and the whole lm_head.
Prefill is bound by the matrix units: 2 FLOPs per active weight per token, plus causal
attention, which grows with the prompt. The numbers of BENCHMARK.md for Qwen3.6-35B-A3B
(1.80 GB + 20 KB x context; ~4.87 GFLOP per token) come out of these formulas. Dense
vectors (norms, biases, gates' dt/A) are under 0.01% of the bytes and left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .. import _lily

BF16, FP32 = 2, 4


def bits_per_weight(bits: int, group_size: int) -> float:
    """Affine quantization stores a bf16 scale and bias (32 bits) per group."""
    return bits + 32 / group_size


@dataclass(frozen=True)
class Dims:
    """The sizes the rooflines need, from config.json (or its text_config)."""

    hidden: int
    vocab: int
    full_layers: int
    linear_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    gdn_key_heads: int
    gdn_key_dim: int
    gdn_value_heads: int
    gdn_value_dim: int
    conv_kernel: int
    experts: int
    experts_per_token: int
    expert_width: int
    shared_width: int
    bpw: float  # bits per weight of the 4-bit (default) matrices
    gate_bpw: float  # bits per weight of the router and shared-expert gate

    @classmethod
    def from_config(cls, config: dict) -> "Dims":
        t = config.get("text_config", config)
        layers = int(t["num_hidden_layers"])
        kinds = t.get("layer_types") or [
            "full_attention" if (i + 1) % int(t.get("full_attention_interval", 4)) == 0 else "linear_attention"
            for i in range(layers)
        ]
        full = sum(k == "full_attention" for k in kinds)
        default, gate = _quant_specs(config)
        return cls(
            hidden=int(t["hidden_size"]), vocab=int(t["vocab_size"]), full_layers=full, linear_layers=layers - full,
            heads=int(t["num_attention_heads"]), kv_heads=int(t["num_key_value_heads"]), head_dim=int(t["head_dim"]),
            gdn_key_heads=int(t["linear_num_key_heads"]), gdn_key_dim=int(t["linear_key_head_dim"]),
            gdn_value_heads=int(t["linear_num_value_heads"]), gdn_value_dim=int(t["linear_value_head_dim"]),
            conv_kernel=int(t.get("linear_conv_kernel_dim", 4)), experts=int(t["num_experts"]),
            experts_per_token=int(t["num_experts_per_tok"]), expert_width=int(t["moe_intermediate_size"]),
            shared_width=int(t["shared_expert_intermediate_size"]),
            bpw=bits_per_weight(*default), gate_bpw=bits_per_weight(*gate),
        )

    # Weights (element counts) per layer kind, as used by one token.
    @property
    def conv_dim(self) -> int:
        return 2 * self.gdn_key_heads * self.gdn_key_dim + self.gdn_value_heads * self.gdn_value_dim

    def gdn_weights(self) -> int:
        value_dim = self.gdn_value_heads * self.gdn_value_dim
        return self.hidden * (self.conv_dim + 2 * value_dim + 2 * self.gdn_value_heads)  # qkv, z, out, a, b

    def attention_weights(self) -> int:
        q = self.heads * self.head_dim
        return self.hidden * (3 * q + 2 * self.kv_heads * self.head_dim)  # q+gate, k, v, o

    def expert_weights(self) -> int:
        """Routed experts a token uses plus the shared expert (4-bit)."""
        return 3 * self.hidden * (self.experts_per_token * self.expert_width + self.shared_width)

    def gate_weights(self) -> int:
        """Router and shared-expert gate (8-bit)."""
        return self.hidden * (self.experts + 1)

    @property
    def layers(self) -> int:
        return self.full_layers + self.linear_layers

    def kv_bytes_per_position(self) -> int:
        return self.full_layers * 2 * self.kv_heads * self.head_dim * BF16

    def decode_bytes(self, context: float) -> dict[str, float]:
        """Bytes moved by one decode step at `context` cached positions, by component."""
        recurrent = self.gdn_value_heads * self.gdn_key_dim * self.gdn_value_dim
        conv_window = (self.conv_kernel - 1) * self.conv_dim
        experts = self.expert_weights() * self.bpw + self.gate_weights() * self.gate_bpw
        gdn = self.gdn_weights() * self.bpw / 8 + self.conv_dim * self.conv_kernel * BF16
        parts = {
            "experts_and_router": self.layers * experts / 8,
            "gdn_weights": self.linear_layers * gdn,
            "gdn_state": self.linear_layers * 2 * (recurrent + conv_window) * FP32,  # fp32, read and written
            "attention_weights": self.full_layers * self.attention_weights() * self.bpw / 8,
            "lm_head": self.vocab * self.hidden * self.bpw / 8,
            "kv_cache": self.kv_bytes_per_position() * context,
        }
        parts["total"] = sum(parts.values())
        return parts

    def active_weights(self) -> int:
        """Matrix weights one token multiplies through (lm_head excluded)."""
        return (self.layers * (self.expert_weights() + self.gate_weights()) + self.linear_layers * self.gdn_weights()
                + self.full_layers * self.attention_weights())

    def prefill_flops_per_token(self, length: int) -> float:
        """FLOPs per prompt token for a prompt of `length` tokens.

        Linear layers: 2 per active weight; lm_head only for the last token. Causal
        attention: QK^T and PV, 2*head_dim FLOPs each per (query head, key), a query
        seeing (length + 1) / 2 keys on average. Gated DeltaNet: three state-sized
        products per value head (S^T k, the rank-1 update, S^T q).
        """
        linear = 2 * self.active_weights() + 2 * self.vocab * self.hidden / length
        attention = self.full_layers * self.heads * 4 * self.head_dim * (length + 1) / 2
        gdn = self.linear_layers * self.gdn_value_heads * 6 * self.gdn_key_dim * self.gdn_value_dim
        return linear + attention + gdn


def _quant_specs(config: dict) -> tuple[tuple[int, int], tuple[int, int]]:
    """(bits, group) of ordinary matrices and of the gates, as lily will hold them (its checkpoint
    table): the checkpoint's quantization block, or lily's load-time default (4-bit, 8-bit gates)."""
    text = json.dumps(config)
    block = _lily.mlx_quantization(text)
    router = next(t for t in _lily.checkpoint_tensors(text, "mlx") if t["kind"] == "router" and t["part"] == "codes")
    return (block["bits"], block["group_size"]), (router["bits"], router["group_size"])


@dataclass(frozen=True)
class Ceilings:
    """What the device can do: copy bandwidth and dense matmul rate, and where they come from."""

    bandwidth: float  # bytes/s
    matmul: float  # FLOP/s
    source: str

    def decode_tok_s(self, dims: Dims, context: float) -> float:
        return self.bandwidth / dims.decode_bytes(context)["total"]

    def prefill_tok_s(self, dims: Dims, length: int) -> float:
        return self.matmul / dims.prefill_flops_per_token(length)


# BENCHMARK.md's H200 figures, for CUDA runs that cannot measure their own.
H200_DOCUMENTED = Ceilings(4.24e12, 807e12, "BENCHMARK.md's H200 figures (4.24 TB/s copy, 807 TFLOP/s bf16), "
                                            "not measured in this run")
