"""lily against MLX-LM, the exact MLX affine-quantized semantics (BENCHMARK.md's
consistency contract).

The synthetic checkpoints are lily.synthetic HF bf16 checkpoints converted by MLX-LM's
own converter (4-bit group 64 and 8-bit group 32, with MLX-LM's 8-bit router and
shared-expert gate), so lily reads files MLX-LM wrote; lily-tiny, the trained model in
the package, is compared on real Python source. MLX-LM runs in float32 on the stored
codes (scales, biases and every other float parameter cast to float32), and lily's CPU
executor must match it teacher-forced over 256 positions: the contract's thresholds and,
since both are float32 on the same values, float32-rounding closeness. The same file
checks lily against itself: prefill + decode against teacher forcing, prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import lily
from lily import hub
from lily.consistency import benchmark_tokens, compare, kl_divergence
from reference.consistency import (CONTRACT_MEAN_KL_MAX, assert_fp32_close, assert_meets_contract,
                                   float_parameter_dtypes, lily_tiny_text_ids, load_mlx_lm_fp32, mlx_lm_logits,
                                   odd_config, quantized_modules, write_mlx_lm_checkpoint)

N_POSITIONS = 256

# Synthetic checkpoints written by MLX-LM's converter (their configs), and lily-tiny, the
# trained model shipped in the package (written by lily convert), on real Python source.
VARIANTS = {  # name: (config, MLX-LM's bits and group size)
    "tiny": (None, 4, 64),  # synthetic's default tiny config
    "tiny_8bit_group32": (None, 8, 32),
    "odd_dims": (odd_config(), 4, 64),
    "odd_dims_tied": (odd_config(tie_word_embeddings=True), 4, 64),
    "lily_tiny": ("lily-tiny", 4, 64),
}


@dataclass
class Case:
    directory: Path            # the MLX checkpoint
    hf_directory: Path | None  # the HF bf16 checkpoint it was converted from (synthetic ones)
    bits: int                  # of everything but the 8-bit router and shared-expert gate
    group_size: int
    ids: np.ndarray            # the teacher-forced sequence
    ref: np.ndarray            # MLX-LM's float32 logits over it
    mlx_model: object          # the float32 MLX-LM model


@pytest.fixture(scope="module", params=list(VARIANTS))
def mlx_case(request, tmp_path_factory) -> Case:
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    config, bits, group_size = VARIANTS[request.param]
    if config == "lily-tiny":
        directory, hf_directory = hub.lily_tiny_dir(), None
        ids = np.array(lily_tiny_text_ids(lily.Model.load(str(directory), device="cpu"), N_POSITIONS))
    else:
        directory = write_mlx_lm_checkpoint(tmp_path_factory.mktemp(f"mlx_lm_{request.param}"), config=config,
                                            seed=1, bits=bits, group_size=group_size)
        hf_directory, ids = directory.parent / "hf", None
    model = load_mlx_lm_fp32(directory)
    if ids is None:
        ids = benchmark_tokens(N_POSITIONS, model.language_model.args.vocab_size)
    return Case(directory, hf_directory, bits, group_size, ids, mlx_lm_logits(model, ids), model)


@pytest.fixture(scope="module")
def mlx_lily_model(mlx_case):
    return lily.Model.load(str(mlx_case.directory), device="cpu")


def test_reference_computes_in_fp32_on_the_stored_codes(mlx_case, mlx_lily_model):
    """The reference really is a quantized MLX-LM model (linears, embedding and experts
    at the variant's bits; 8-bit router and shared-expert gate), its codes still packed
    uint32 and every float parameter float32; and lily recognises the MLX layout."""
    model = mlx_case.mlx_model
    q = quantized_modules(model)
    assert {kind[1:] for kind in q.values()} == {("mlx.core.uint32", "mlx.core.float32", "mlx.core.float32")}, q
    gates = {p for p in q if p.endswith(("mlp.gate", "shared_expert_gate"))}
    assert gates and all(q[p][0] == 8 for p in gates)
    assert all(q[p][0] == mlx_case.bits for p in q if p not in gates)
    assert any(p.endswith("switch_mlp.gate_proj") for p in q) and any(p.endswith("embed_tokens") for p in q)
    assert float_parameter_dtypes(model) == {"mlx.core.float32"}
    assert mlx_lily_model._engine.source_layout == "mlx"


def test_reference_is_informative(mlx_case):
    """Guards the comparison against a degenerate reference (e.g. near-uniform logits),
    against which any engine would 'agree'."""
    ref = mlx_case.ref
    assert np.isfinite(ref).all()
    assert len(np.unique(ref.argmax(-1))) >= 10
    # Neighbouring positions' distributions differ far more than the threshold allows.
    assert kl_divergence(ref[1:], ref[:-1]).mean() > 20 * CONTRACT_MEAN_KL_MAX


def test_teacher_forced_logits_match_mlx_lm(mlx_case, mlx_lily_model):
    ids, ref = mlx_case.ids, mlx_case.ref
    got = mlx_lily_model.logits(ids)
    assert got.shape == ref.shape and got.dtype == np.float32
    assert np.isfinite(got).all()
    c = compare(ref, got, ids)
    print(c)
    assert_meets_contract(c)
    assert_fp32_close(c)  # the CPU executor is float32 on the same stored values


def test_chunked_prefill_matches_mlx_lm(mlx_case):
    """Prefill in chunks of 13 (KV cache and GDN state carried over 20 chunk seams)."""
    got = lily.Model.load(str(mlx_case.directory), device="cpu", prefill_chunk=13).logits(mlx_case.ids)
    assert_fp32_close(compare(mlx_case.ref, got, mlx_case.ids))


def test_hf_checkpoint_loads_as_its_mlx_lm_conversion(mlx_case, mlx_lily_model):
    """lily reading the bf16 HF checkpoint (quantizing at load, shifting the norms,
    splitting the fused experts) computes what MLX-LM does on its own conversion."""
    if mlx_case.hf_directory is None:
        pytest.skip("lily-tiny ships without its HF checkpoint")
    if (mlx_case.bits, mlx_case.group_size) != (4, 64):
        pytest.skip("lily quantizes HF checkpoints at load to 4-bit, group 64 only")
    ids, ref = mlx_case.ids, mlx_case.ref
    from_hf = lily.Model.load(str(mlx_case.hf_directory), device="cpu")
    assert from_hf._engine.source_layout == "hf"
    got = from_hf.logits(ids)
    assert_fp32_close(compare(ref, got, ids))
    # Quantized bit-identically with mx.quantize, so even the float32 rounding agrees.
    np.testing.assert_array_equal(got, mlx_lily_model.logits(ids))


# ---- lily against itself ------------------------------------------------------------


def _vocab(model) -> int:
    return int(model.config["vocab_size"])


def test_greedy_decode_matches_teacher_forcing(tiny_model):
    """Each greedily generated token is the argmax of the teacher-forced logits of the
    whole generated sequence at that position (decode path == prefill path)."""
    prompt = benchmark_tokens(40, _vocab(tiny_model)).tolist()
    r = tiny_model.generate(prompt, max_tokens=32, ignore_eos=True)
    assert r.finish_reason == "length" and len(r.token_ids) == 32
    seq = prompt + r.token_ids
    tf = tiny_model.logits(seq)
    # Row t predicts token t + 1. Sampling never picks the padded vocabulary rows
    # beyond the tokenizer's, so neither does this argmax.
    rows = tf[len(prompt) - 1 : len(seq) - 1, : tiny_model.tokenizer.vocab_size]
    chosen = rows[np.arange(len(r.token_ids)), r.token_ids]
    # Exact argmax, except where the teacher-forced top two are a near-tie.
    gap = rows.max(-1) - chosen
    assert np.all(gap <= 1e-4 * np.abs(rows).max(-1)), (np.argmax(rows, -1), r.token_ids)


def test_session_last_logits_match_teacher_forced_row(tiny_model):
    """prefill's returned logits (the session's last_logits) equal the teacher-forced
    row, after a prompt and after decoding (pending token fed by the next prefill)."""
    prompt = benchmark_tokens(50, _vocab(tiny_model)).tolist()
    s = tiny_model.new_session()
    last = s.prefill(prompt)
    tf = tiny_model.logits(prompt)
    np.testing.assert_allclose(last, tf[-1], rtol=1e-5, atol=1e-5)

    r = s.generate(max_tokens=12, ignore_eos=True)
    extra = benchmark_tokens(3, _vocab(tiny_model), offset=1000).tolist()
    last = s.prefill(extra)  # feeds the pending generated token, then `extra`
    seq = prompt + r.token_ids + extra
    assert s.tokens == seq and s.position == len(seq)
    tf = tiny_model.logits(seq)
    np.testing.assert_allclose(last, tf[-1], rtol=1e-4, atol=1e-4)


def test_session_logits_continue_teacher_forcing(tiny_model):
    """Session.logits over a sequence fed in pieces equals Model.logits of the whole."""
    seq = benchmark_tokens(90, _vocab(tiny_model)).tolist()
    s = tiny_model.new_session()
    parts = [s.logits(seq[:1]), s.logits(seq[1:37]), s.logits(seq[37:])]
    got = np.concatenate(parts)
    np.testing.assert_allclose(got, tiny_model.logits(seq), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk", [1, 7, 64, 65])
def test_prefill_chunk_size_does_not_change_logits(tiny_mlx_dir, tiny_model, chunk):
    """Chunked prefill (KV cache and GDN state carried across chunks) gives the same
    teacher-forced logits as one chunk; 150 tokens cross GDN's 64-token blocks."""
    ids = benchmark_tokens(150, _vocab(tiny_model))
    one_chunk = tiny_model.logits(ids)  # prefill_chunk=512: a single chunk
    chunked = lily.Model.load(str(tiny_mlx_dir), device="cpu", prefill_chunk=chunk).logits(ids)
    np.testing.assert_allclose(chunked, one_chunk, rtol=1e-4, atol=1e-4)
