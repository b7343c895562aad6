"""Plain numpy references of lily's ops (docs/MODEL.md §3.3, §4, §5).

Each function states the maths in the most direct way: whole-array operations, loops only
where the maths is sequential. Arithmetic is float64 (returned as float32), so a kernel's
error can be measured against these. Exceptions are noted where a reference deliberately
follows a float32 rounding of the model definition (RoPE angles).

A quantized matrix is a tuple ``(codes, scales, biases, group_size, bits)``:
codes uint32 [..., N, K*bits/32], scales/biases bf16 bits (uint16) [..., N, K/group_size],
and w = scale * q + bias (MLX affine format, MODEL.md §3.3).
"""

from __future__ import annotations

import numpy as np

F64 = np.float64


# ---- bf16 and the MLX affine format ----------------------------------------------------


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) to float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 to bf16 bit patterns, round to nearest even (finite inputs)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def unpack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [..., words] to integers [..., words*32/bits]: element per_word*j + n is
    (word[j] >> bits*n) & (2^bits - 1)."""
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
    q = (codes[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return q.reshape(*codes.shape[:-1], codes.shape[-1] * per_word)


def dequantize(qw) -> np.ndarray:
    """The float32 matrix (stack) of a quantized tuple: scale * q + bias per group."""
    codes, scales, biases, group_size, bits = qw
    q = unpack_codes(codes, bits).astype(np.float32)
    s, b = bf16_to_f32(scales), bf16_to_f32(biases)
    groups = q.reshape(*q.shape[:-1], -1, group_size)
    return (groups * s[..., None] + b[..., None]).reshape(q.shape)


def random_qweight(rng: np.random.Generator, rows: int, cols: int, *, group_size: int = 64, bits: int = 4,
                   experts: int | None = None, spread: float = 1.0):
    """A random quantized matrix with entries of about +-spread/sqrt(cols): random codes,
    scales of either sign (the format allows negative scales), biases centring each group."""
    lead = () if experts is None else (experts,)
    codes = rng.integers(0, 2**32, size=(*lead, rows, cols * bits // 32), dtype=np.uint64).astype(np.uint32)
    levels = (1 << bits) - 1
    step = spread * 2.0 / np.sqrt(cols) / levels
    scales = step * rng.uniform(0.5, 1.5, size=(*lead, rows, cols // group_size)) * rng.choice([-1, 1], size=(*lead, rows, cols // group_size))
    biases = -scales * levels / 2 + rng.normal(0, step, size=scales.shape)
    return codes, f32_to_bf16(scales), f32_to_bf16(biases), group_size, bits


# ---- ops ------------------------------------------------------------------------------


def qmatmul(x, qw) -> np.ndarray:
    """y[T, N] = x[T, K] @ W^T."""
    return (np.asarray(x, F64) @ dequantize(qw).astype(F64).T).astype(np.float32)


def embedding(ids, table) -> np.ndarray:
    """Rows ids of the dequantized table [V, H]."""
    return dequantize(table)[np.asarray(ids)]


def rmsnorm(x, w, eps) -> np.ndarray:
    """x * rsqrt(mean(x^2) + eps) * w over the last axis."""
    x = np.asarray(x, F64)
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(w, F64)).astype(np.float32)


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.logaddexp(0.0, x)


def gated_rmsnorm(x, z, w, eps) -> np.ndarray:
    """The GDN output norm: rmsnorm(x) * w * silu(z)."""
    return (rmsnorm(x, w, eps).astype(F64) * silu(np.asarray(z, F64))).astype(np.float32)


def l2norm(x, eps, scale) -> np.ndarray:
    """x * rsqrt(sum(x^2) + eps) * scale over the last axis."""
    x = np.asarray(x, F64)
    return (x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps) * scale).astype(np.float32)


def rope_angles(T: int, rotary_dim: int, pos0: int, theta: float) -> np.ndarray:
    """Angles [T, rotary_dim/2]. The model defines them in float32 (transformers and MLX
    both form inv_freq and pos * inv_freq in float32); that rounding is kept."""
    j = np.arange(rotary_dim // 2, dtype=F64)
    inv_freq = (theta ** (-2.0 * j / rotary_dim)).astype(np.float32)
    pos = np.arange(pos0, pos0 + T, dtype=np.float32)
    return (pos[:, None] * inv_freq[None, :]).astype(F64)


def rope(x, rotary_dim, pos0, theta) -> np.ndarray:
    """Partial NeoX RoPE on x [T, heads, head_dim]: dims j and j + R/2 (j < R/2) rotate."""
    x = np.asarray(x, F64).copy()
    T, half = x.shape[0], rotary_dim // 2
    ang = rope_angles(T, rotary_dim, pos0, theta)[:, None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    lo, hi = x[..., :half].copy(), x[..., half:rotary_dim].copy()
    x[..., :half] = lo * cos - hi * sin
    x[..., half:rotary_dim] = hi * cos + lo * sin
    return x.astype(np.float32)


def gated_delta_conv(x, w, state):
    """silu(causal depthwise conv) of x [T, C] with w [C, Kc] (tap Kc-1 = current token),
    state [Kc-1, C] the rows before x. Returns (y [T, C], new state)."""
    x, w, state = np.asarray(x, F64), np.asarray(w, F64), np.asarray(state, F64)
    T, Kc = x.shape[0], w.shape[1]
    u = np.concatenate([state, x], axis=0)
    y = sum(w[:, j] * u[j:j + T] for j in range(Kc))
    return silu(y).astype(np.float32), u[T:].astype(np.float32)


def gated_delta_gates(a, b, A_log, dt_bias):
    """(g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)), both [T, Hv]."""
    a, b = np.asarray(a, F64), np.asarray(b, F64)
    g = -np.exp(np.asarray(A_log, F64)) * softplus(a + np.asarray(dt_bias, F64))
    return g.astype(np.float32), sigmoid(b).astype(np.float32)


def gated_delta(q, k, v, g, beta, state):
    """The recurrence of MODEL.md §4.5 step 7, token by token. q, k [T, Hk, Dk] (normalised),
    v [T, Hv, Dv], g, beta [T, Hv], state [Hv, Dk, Dv]. Returns (o [T, Hv, Dv], state)."""
    q, k, v = (np.asarray(a, F64) for a in (q, k, v))
    g, beta, S = np.asarray(g, F64), np.asarray(beta, F64), np.asarray(state, F64).copy()
    T, Hk = q.shape[:2]
    Hv = v.shape[1]
    heads = np.arange(Hv) // (Hv // Hk)  # key head of each value head
    o = np.zeros(v.shape)
    for t in range(T):
        qt, kt = q[t, heads], k[t, heads]  # [Hv, Dk]
        S *= np.exp(g[t])[:, None, None]
        kv = np.einsum("hkv,hk->hv", S, kt)
        delta = (v[t] - kv) * beta[t][:, None]
        S += kt[:, :, None] * delta[:, None, :]
        o[t] = np.einsum("hkv,hk->hv", S, qt)
    return o.astype(np.float32), S.astype(np.float32)


def gated_delta_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The same recurrence in the chunked (WY) form of MODEL.md §5, C tokens at a time;
    equal to gated_delta in exact arithmetic. Same arguments and results."""
    q, k, v = (np.asarray(a, F64) for a in (q, k, v))
    g, beta, S = np.asarray(g, F64), np.asarray(beta, F64), np.asarray(state, F64).copy()
    T, Hk = q.shape[:2]
    Hv = v.shape[1]
    heads = np.arange(Hv) // (Hv // Hk)
    o = np.zeros(v.shape)
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        for h in range(Hv):
            Q, K, V = q[c0:c1, heads[h]], k[c0:c1, heads[h]], v[c0:c1, h]
            b, gamma = beta[c0:c1, h], np.cumsum(g[c0:c1, h])
            n = c1 - c0
            D = np.tril(np.exp(gamma[:, None] - gamma[None, :]))  # includes the diagonal
            A = np.tril((b[:, None] * (K @ K.T)) * D, -1)
            inv = np.linalg.inv(np.eye(n) + A)
            U = inv @ (b[:, None] * V)
            W = inv @ ((b * np.exp(gamma))[:, None] * K)
            Vn = U - W @ S[h]
            o[c0:c1, h] = (Q * np.exp(gamma)[:, None]) @ S[h] + ((Q @ K.T) * D) @ Vn
            S[h] = np.exp(gamma[-1]) * S[h] + (K * np.exp(gamma[-1] - gamma)[:, None]).T @ Vn
    return o.astype(np.float32), S.astype(np.float32)


def attention(q, k, v, scale):
    """Causal GQA: q [T, Hq, D] are the last T of L = k.shape[0] positions; k, v [L, Hkv, D];
    query head h reads KV head h // (Hq/Hkv)."""
    q, k, v = (np.asarray(a, F64) for a in (q, k, v))
    T, Hq = q.shape[:2]
    L, Hkv = k.shape[:2]
    kh = k[:, np.arange(Hq) // (Hq // Hkv)]  # [L, Hq, D]
    vh = v[:, np.arange(Hq) // (Hq // Hkv)]
    s = np.einsum("thd,lhd->htl", q, kh) * scale
    visible = np.arange(L)[None, :] <= (L - T + np.arange(T))[:, None]  # [T, L]
    s = np.where(visible[None], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("htl,lhd->thd", p, vh).astype(np.float32)


def moe_router(logits, top_k, renormalize):
    """softmax over E, the top_k experts by probability (ties: lower index first), their
    probabilities renormalised to sum 1 when asked. Returns (experts int32, weights)."""
    x = np.asarray(logits, F64)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    experts = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, experts, axis=-1)
    if renormalize:
        w /= w.sum(axis=-1, keepdims=True)
    return experts.astype(np.int32), w.astype(np.float32)


def moe_experts(x, gate, up, down):
    """One expert's SwiGLU MLP (routed or shared): down(silu(x gate^T) * (x up^T))."""
    x = np.asarray(x, F64)
    g = x @ dequantize(gate).astype(F64).T
    u = x @ dequantize(up).astype(F64).T
    return ((silu(g) * u) @ dequantize(down).astype(F64).T).astype(np.float32)


def _expert(qw, e):
    codes, scales, biases, group_size, bits = qw
    return codes[e], scales[e], biases[e], group_size, bits


def moe_block(x, weights: dict, top_k: int, norm_topk_prob: bool):
    """Routed experts weighted by the router plus the sigmoid-gated shared expert."""
    x = np.asarray(x, np.float32)
    experts, w = moe_router(qmatmul(x, weights["router"]), top_k, norm_topk_prob)
    out = np.zeros(x.shape, F64)
    for e in np.unique(experts):  # each expert once, over the tokens that chose it
        rows, slots = np.nonzero(experts == e)
        y = moe_experts(x[rows], _expert(weights["gate_proj"], e), _expert(weights["up_proj"], e),
                        _expert(weights["down_proj"], e))
        out[rows] += w[rows, slots].astype(F64)[:, None] * y
    shared = moe_experts(x, weights["shared_gate_proj"], weights["shared_up_proj"], weights["shared_down_proj"])
    gate = sigmoid(qmatmul(x, weights["shared_expert_gate"]).astype(F64))
    return (out + gate * shared).astype(np.float32)


def gated_delta_step(mixed, z, b, a, conv_w, conv_state, A_log, dt_bias, norm, state, num_key_heads, eps):
    """The Gated DeltaNet mixer between its projections (MODEL.md §4.5): mixed [T, 2 Hk Dk + Hv Dv]
    (q | k | v before the conv), z [T, Hv, Dv], b, a [T, Hv]. Returns (out [T, Hv, Dv],
    conv_state, state)."""
    T, Hv, Dv = z.shape
    Hk, Dk = num_key_heads, state.shape[1]
    c, conv_state = gated_delta_conv(mixed, conv_w, conv_state)
    kd = Hk * Dk
    q = l2norm(c[:, :kd].reshape(T, Hk, Dk), 1e-6, Dk ** -0.5)
    k = l2norm(c[:, kd:2 * kd].reshape(T, Hk, Dk), 1e-6, 1.0)
    v = c[:, 2 * kd:].reshape(T, Hv, Dv)
    g, beta = gated_delta_gates(a, b, A_log, dt_bias)
    o, state = gated_delta(q, k, v, g, beta, state)
    return gated_rmsnorm(o, z, norm, eps), conv_state, state


def gated_delta_mixer(x, weights: dict, conv_state, recurrent_state, num_key_heads, num_value_heads,
                      key_head_dim, value_head_dim, eps):
    """One Gated DeltaNet mixer (MODEL.md §4.5). Returns (out, conv_state, recurrent_state)."""
    T, Hv, Dv = x.shape[0], num_value_heads, value_head_dim
    mixed = qmatmul(x, weights["in_proj_qkv"])
    z = qmatmul(x, weights["in_proj_z"]).reshape(T, Hv, Dv)
    b = qmatmul(x, weights["in_proj_b"])
    a = qmatmul(x, weights["in_proj_a"])
    o, conv_state, recurrent_state = gated_delta_step(mixed, z, b, a, weights["conv1d"], conv_state, weights["A_log"],
                                                      weights["dt_bias"], weights["norm"], recurrent_state,
                                                      num_key_heads, eps)
    return qmatmul(o.reshape(T, Hv * Dv), weights["out_proj"]), conv_state, recurrent_state


def gated_attention(qg, k, v, q_norm, k_norm, k_cache, v_cache, rotary_dim, theta, eps):
    """The attention mixer between its projections (MODEL.md §4.4): qg [T, Hq, 2D] (per head D
    query values, then D gate values), k, v [T, Hkv, D] after pos0 = len(k_cache) cached
    positions. Returns (out [T, Hq, D], k_cache, v_cache) with the chunk appended."""
    D, pos0 = k.shape[-1], k_cache.shape[0]
    q, gate = qg[..., :D], qg[..., D:]
    q = rope(rmsnorm(q, q_norm, eps), rotary_dim, pos0, theta)
    k = rope(rmsnorm(k, k_norm, eps), rotary_dim, pos0, theta)
    k_cache = np.concatenate([k_cache, k]).astype(np.float32)
    v_cache = np.concatenate([v_cache, v]).astype(np.float32)
    o = attention(q, k_cache, v_cache, D ** -0.5).astype(F64) * sigmoid(gate.astype(F64))
    return o.astype(np.float32), k_cache, v_cache


def attention_mixer(x, weights: dict, k_cache, v_cache, num_heads, num_kv_heads, head_dim, partial_rotary_factor,
                    rope_theta, eps):
    """One gated attention mixer (MODEL.md §4.4) after pos0 = len(k_cache) cached positions.
    Returns (out, k_cache, v_cache) with the chunk appended."""
    T, Hq, Hkv, D = x.shape[0], num_heads, num_kv_heads, head_dim
    qg = qmatmul(x, weights["q_proj"]).reshape(T, Hq, 2 * D)
    k = qmatmul(x, weights["k_proj"]).reshape(T, Hkv, D)
    v = qmatmul(x, weights["v_proj"]).reshape(T, Hkv, D)
    o, k_cache, v_cache = gated_attention(qg, k, v, weights["q_norm"], weights["k_norm"], k_cache, v_cache,
                                          int(D * partial_rotary_factor), rope_theta, eps)
    return qmatmul(o.reshape(T, Hq * D), weights["o_proj"]), k_cache, v_cache


def mtp_head(hidden, next_tokens, weights: dict, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
             partial_rotary_factor, rope_theta, eps, top_k, norm_topk_prob):
    """The MTP head (MODEL.md §7) over rows of the trunk's normed hidden state and the next
    token, after len(k_cache) cached positions. Returns (out after mtp.norm, k_cache, v_cache)."""
    e = rmsnorm(embedding(next_tokens, weights["embed_tokens"]), weights["pre_fc_norm_embedding"], eps)
    h = rmsnorm(hidden, weights["pre_fc_norm_hidden"], eps)
    u = qmatmul(np.concatenate([e, h], axis=1), weights["fc"])
    a, k_cache, v_cache = attention_mixer(rmsnorm(u, weights["input_layernorm"], eps), weights, k_cache, v_cache,
                                          num_heads, num_kv_heads, head_dim, partial_rotary_factor, rope_theta, eps)
    u = u + a
    u = u + moe_block(rmsnorm(u, weights["post_attention_layernorm"], eps), weights, top_k, norm_topk_prob)
    return rmsnorm(u, weights["norm"], eps), k_cache, v_cache
