"""The tensors of docs/MODEL.md §2-3, spelled out independently of lily's checkpoint table, so
that tests can check the table (and what lily.synthetic and lily convert write) against them."""

from __future__ import annotations


def expected_mlx(c: dict) -> dict:
    """The MLX 4-bit tensors of docs/MODEL.md §3 for text_config c (group size 64)."""
    H, V, E = c["hidden_size"], c["vocab_size"], c["num_experts"]
    I, Is = c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    Hv, Dv, D = c["linear_num_value_heads"], c["linear_value_head_dim"], c["head_dim"]
    conv = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + Hv * Dv
    out = {}

    def q(module, *shape, bits=4):
        *lead, k = shape
        out[module + ".weight"] = ("U32", [*lead, k * bits // 32])
        out[module + ".scales"] = out[module + ".biases"] = ("BF16", [*lead, k // 64])

    m = "language_model.model."
    q(m + "embed_tokens", V, H)
    if not c.get("tie_word_embeddings"):
        q("language_model.lm_head", V, H)
    out[m + "norm.weight"] = ("BF16", [H])
    for i, kind in enumerate(c["layer_types"]):
        l = f"{m}layers.{i}."
        out[l + "input_layernorm.weight"] = out[l + "post_attention_layernorm.weight"] = ("BF16", [H])
        if kind == "linear_attention":
            a = l + "linear_attn."
            q(a + "in_proj_qkv", conv, H)
            q(a + "in_proj_z", Hv * Dv, H)
            q(a + "in_proj_b", Hv, H)
            q(a + "in_proj_a", Hv, H)
            q(a + "out_proj", H, Hv * Dv)
            out[a + "conv1d.weight"] = ("BF16", [conv, c["linear_conv_kernel_dim"], 1])
            out[a + "dt_bias"] = ("BF16", [Hv])
            out[a + "A_log"] = ("F32", [Hv])
            out[a + "norm.weight"] = ("BF16", [Dv])
        else:
            a = l + "self_attn."
            q(a + "q_proj", 2 * c["num_attention_heads"] * D, H)
            q(a + "k_proj", c["num_key_value_heads"] * D, H)
            q(a + "v_proj", c["num_key_value_heads"] * D, H)
            q(a + "o_proj", H, c["num_attention_heads"] * D)
            out[a + "q_norm.weight"] = out[a + "k_norm.weight"] = ("BF16", [D])
        p = l + "mlp."
        q(p + "gate", E, H, bits=8)
        q(p + "shared_expert_gate", 1, H, bits=8)
        q(p + "shared_expert.gate_proj", Is, H)
        q(p + "shared_expert.up_proj", Is, H)
        q(p + "shared_expert.down_proj", H, Is)
        q(p + "switch_mlp.gate_proj", E, I, H)
        q(p + "switch_mlp.up_proj", E, I, H)
        q(p + "switch_mlp.down_proj", E, H, I)
    return out


def expected_hf(c: dict, per_expert: bool = False, prefix: str = "model.language_model.") -> dict:
    """The bf16 tensors of docs/MODEL.md §2 for text_config c (prefix "model.": a text-only
    checkpoint's, Qwen3_5MoeForCausalLM's own names)."""
    H, V, E = c["hidden_size"], c["vocab_size"], c["num_experts"]
    I, Is = c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    Hv, Dv, D = c["linear_num_value_heads"], c["linear_value_head_dim"], c["head_dim"]
    conv = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + Hv * Dv
    m = prefix
    out = {m + "embed_tokens.weight": [V, H], m + "norm.weight": [H]}
    if not c.get("tie_word_embeddings"):
        out["lm_head.weight"] = [V, H]
    for i, kind in enumerate(c["layer_types"]):
        l = f"{m}layers.{i}."
        out[l + "input_layernorm.weight"] = out[l + "post_attention_layernorm.weight"] = [H]
        if kind == "linear_attention":
            a = l + "linear_attn."
            out.update({a + "in_proj_qkv.weight": [conv, H], a + "in_proj_z.weight": [Hv * Dv, H],
                        a + "in_proj_b.weight": [Hv, H], a + "in_proj_a.weight": [Hv, H],
                        a + "conv1d.weight": [conv, 1, c["linear_conv_kernel_dim"]], a + "dt_bias": [Hv],
                        a + "A_log": [Hv], a + "norm.weight": [Dv], a + "out_proj.weight": [H, Hv * Dv]})
        else:
            a = l + "self_attn."
            kv = c["num_key_value_heads"] * D
            out.update({a + "q_proj.weight": [2 * c["num_attention_heads"] * D, H], a + "k_proj.weight": [kv, H],
                        a + "v_proj.weight": [kv, H], a + "o_proj.weight": [H, c["num_attention_heads"] * D],
                        a + "q_norm.weight": [D], a + "k_norm.weight": [D]})
        p = l + "mlp."
        out.update({p + "gate.weight": [E, H], p + "shared_expert.gate_proj.weight": [Is, H],
                    p + "shared_expert.up_proj.weight": [Is, H], p + "shared_expert.down_proj.weight": [H, Is],
                    p + "shared_expert_gate.weight": [1, H]})
        if per_expert:
            for e in range(E):
                out.update({f"{p}experts.{e}.gate_proj.weight": [I, H], f"{p}experts.{e}.up_proj.weight": [I, H],
                            f"{p}experts.{e}.down_proj.weight": [H, I]})
        else:
            out.update({p + "experts.gate_up_proj": [E, 2 * I, H], p + "experts.down_proj": [E, H, I]})
    return {k: ("F32" if k.endswith("A_log") else "BF16", v) for k, v in out.items()}
