"""lily against Hugging Face transformers' Qwen3_5MoeForCausalLM (float32, CPU, eager).

The checkpoint is an MLX-LM-written affine 4-bit checkpoint (see test_reference_mlx);
transformers gets its weights dequantized exactly in float32, with the norms shifted
back to HF's zero-centred form, conv1d in torch's layout and the experts fused again.
The reference is thus transformers' own maths (HF RoPE, chunked Gated DeltaNet, top-k
router, fused experts) on exactly the values lily reads.
"""

from __future__ import annotations

import numpy as np
import pytest

import lily
from lily import hub
from lily.consistency import benchmark_tokens, compare
from reference.consistency import (assert_fp32_close, assert_meets_contract, hf_logits, hf_model_from_mlx,
                                   lily_tiny_text_ids, odd_config, write_mlx_lm_checkpoint)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("mlx_lm")

N_POSITIONS = 512

VARIANTS = {
    "tiny": lambda: None,
    "odd_dims_tied": lambda: odd_config(tie_word_embeddings=True),
    "lily_tiny": "lily-tiny",  # the trained model shipped in the package, on real Python source
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def hf_case(request, tmp_path_factory):
    """(MLX checkpoint dir, token ids, transformers float32 logits)."""
    torch.manual_seed(0)
    variant = VARIANTS[request.param]
    if variant == "lily-tiny":
        directory = hub.lily_tiny_dir()
        ids = np.array(lily_tiny_text_ids(lily.Model.load(str(directory), device="cpu"), N_POSITIONS))
    else:
        directory = write_mlx_lm_checkpoint(tmp_path_factory.mktemp(f"hf_ref_{request.param}"), config=variant(),
                                            seed=2)
        ids = None
    model = hf_model_from_mlx(directory)
    if ids is None:
        ids = benchmark_tokens(N_POSITIONS, model.config.vocab_size)
    ref = hf_logits(model, ids)
    assert np.isfinite(ref).all() and len(np.unique(ref.argmax(-1))) >= 10  # not a degenerate reference
    return directory, ids, ref


@pytest.fixture(scope="module")
def hf_lily_model(hf_case):
    return lily.Model.load(str(hf_case[0]), device="cpu")


def test_teacher_forced_logits_match_transformers(hf_case, hf_lily_model):
    _, ids, ref = hf_case
    c = compare(ref, hf_lily_model.logits(ids), ids)
    print(c)
    assert_meets_contract(c)
    assert_fp32_close(c)


def test_token_by_token_decode_matches_transformers(hf_case, hf_lily_model):
    """512 single-token steps (lily's decode path: the Gated DeltaNet recurrence and
    the KV cache carried step by step) against transformers' one-shot chunked forward."""
    _, ids, ref = hf_case
    s = hf_lily_model.new_session(max_context=len(ids))
    got = np.concatenate([s.logits(ids[t : t + 1]) for t in range(len(ids))])
    c = compare(ref, got, ids)
    print(c)
    assert_meets_contract(c)
    assert_fp32_close(c)
