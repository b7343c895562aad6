"""The MTP head (MODEL.md §7) on the CPU executor: its weights in both layouts and through
`lily convert --keep-mtp`, its drafts against the numpy reference of tests/reference/model.py,
its cache through prompts, chunks, verify and keep, and bad calls refused by name."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest

from lily import _lily, synthetic
from lily.convert import convert
from lily.speculative import greedy_round
from reference.model import ReferenceModel

SEED = 11
PROMPT = np.array([3, 17, 250, 9, 41, 5, 77, 120, 8, 64, 33, 2], np.int32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {layout: synthetic.write_checkpoint(root / layout, layout=layout, seed=SEED, mtp=True)
            for layout in ("mlx", "hf")}


CUDA = "cuda" in _lily.available_devices()


def on_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="no CUDA device")(test))


def engine(path, mtp=True, device="cpu"):
    e = _lily.Engine(str(path), device=device)
    e.use_mtp = mtp
    return e


def fed(e, tokens, chunk=0):
    """A session holding tokens (fed in chunks of `chunk`; 0: at once) and its last logits."""
    s = e.new_session(128)
    step = chunk or len(tokens)
    for i in range(0, len(tokens), step):
        logits = e.forward(s, tokens[i:i + step])
    return s, logits


def rel_err(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def test_drafts_match_the_reference(ckpt):
    e = engine(ckpt["mlx"])
    s, last = fed(e, PROMPT)
    nxt = int(np.argmax(last))
    drafts, logits = e.draft(s, nxt, 3, logits=True)

    ref = ReferenceModel(ckpt["mlx"])
    hidden = ref.hidden(PROMPT)
    c = ref.c
    empty = np.zeros((0, c["num_key_value_heads"], c["head_dim"]), np.float32)
    _, cache = ref.mtp(hidden[:-1], PROMPT[1:], (empty, empty))  # the prompt's rows, shifted left
    x, token = hidden[-1:], nxt
    for i in range(3):
        x, cache = ref.mtp(x, np.array([token]), cache)  # recursive: the head's own normed output
        want = ref.logits(x)[0]
        assert rel_err(logits[i], want) < 1e-4, i
        assert drafts[i] == np.argmax(want), i
        token = int(drafts[i])


def test_both_layouts_and_keep_mtp_convert_give_the_same_head(ckpt, tmp_path):
    tokens = PROMPT[:8]
    results = []
    out = convert(ckpt["hf"], tmp_path / "kept", keep_mtp=True)
    plain = convert(ckpt["hf"], tmp_path / "plain")
    for path in (ckpt["mlx"], ckpt["hf"], out):
        e = engine(path)
        s, last = fed(e, tokens)
        results.append(e.draft(s, int(np.argmax(last)), 3, logits=True))
    for drafts, logits in results[1:]:
        np.testing.assert_array_equal(drafts, results[0][0])
        np.testing.assert_array_equal(logits, results[0][1])
    # The trunk's file is byte for byte what a conversion without the head writes.
    assert (out / "model.safetensors").read_bytes() == (plain / "model.safetensors").read_bytes()
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {f for n, f in index.items() if ".mtp." in n} == {"model-mtp.safetensors"}
    assert not _lily.Engine(str(plain), device="cpu").has_mtp


def test_drafting_leaves_the_session_as_it_was(ckpt):
    e = engine(ckpt["mlx"])
    s, last = fed(e, PROMPT)
    nxt = int(np.argmax(last))
    first = e.draft(s, nxt, 3, logits=True)
    second = e.draft(s, nxt, 3, logits=True)
    np.testing.assert_array_equal(first[1], second[1])
    after = e.forward(s, np.array([nxt], np.int32))
    t, _ = fed(e, PROMPT)
    np.testing.assert_array_equal(after, e.forward(t, np.array([nxt], np.int32)))


@pytest.mark.parametrize("chunk", [1, 5])
def test_the_head_follows_any_chunking(ckpt, chunk):
    e = engine(ckpt["mlx"])
    s, last = fed(e, PROMPT)
    t, _ = fed(e, PROMPT, chunk)
    nxt = int(np.argmax(last))
    np.testing.assert_array_equal(e.draft(s, nxt, 3, logits=True)[1], e.draft(t, nxt, 3, logits=True)[1])


@pytest.mark.parametrize("keep", [1, 2, 4])
def test_keep_verified_leaves_the_head_as_feeding_only_those(ckpt, keep):
    e = engine(ckpt["mlx"])
    s, last = fed(e, PROMPT)
    step = np.array([int(np.argmax(last)), 7, 99, 3], np.int32)
    choice = e.verify(s, step, logits=False)
    e.keep_verified(s, keep)
    t, _ = fed(e, np.concatenate([PROMPT, step[:keep]]))
    nxt = int(choice[keep - 1])
    np.testing.assert_array_equal(e.draft(s, nxt, 3, logits=True)[1], e.draft(t, nxt, 3, logits=True)[1])


def test_speculation_with_the_head_is_plain_greedy(ckpt):
    e = engine(ckpt["mlx"])
    n = 60
    s, last = fed(e, PROMPT)
    plain = [int(np.argmax(last))]
    while len(plain) < n:
        plain.append(int(np.argmax(e.forward(s, np.array([plain[-1]], np.int32)))))

    s, last = fed(e, PROMPT)
    out, pending = [], int(np.argmax(last))
    while len(out) < n:
        kept, pending = greedy_round(e, s, pending, e.draft(s, pending, 3))
        out += kept
    assert out[:n] == plain


def test_snapshots_carry_the_head(ckpt):
    e = engine(ckpt["mlx"])
    s, last = fed(e, PROMPT)
    nxt = int(np.argmax(last))
    snap = e.clone(s)
    want = e.draft(s, nxt, 3, logits=True)[1]
    e.forward(s, np.array([nxt, 5, 6], np.int32))
    e.restore(s, snap)
    np.testing.assert_array_equal(e.draft(s, nxt, 3, logits=True)[1], want)
    np.testing.assert_array_equal(e.draft(snap, nxt, 3, logits=True)[1], want)
    e.use_mtp = False
    plain = e.new_session(128)
    with pytest.raises(_lily.LilyError, match="snapshot was made with the MTP head and the session without"):
        e.restore(plain, snap)


def test_bad_calls_are_refused_by_name(ckpt, tmp_path):
    e = engine(ckpt["mlx"], mtp=False)
    s, last = fed(e, PROMPT)
    with pytest.raises(_lily.LilyError, match="made without the MTP head"):
        e.draft(s, 1, 2)
    e.use_mtp = True
    s, last = fed(e, PROMPT)
    for n in (0, 4):
        with pytest.raises(_lily.LilyError, match="drafts asked for"):
            e.draft(s, 1, n)
    with pytest.raises(_lily.LilyError, match="holds no token"):
        e.draft(e.new_session(16), 1, 2)
    with pytest.raises(_lily.LilyError, match="outside"):
        e.draft(s, 10**6, 2)

    plain = synthetic.write_checkpoint(tmp_path / "plain", seed=SEED)
    with pytest.raises(_lily.LilyError, match="no MTP head"):
        engine(plain)
    with pytest.raises(_lily.LilyError, match="no MTP head"):
        convert(plain, tmp_path / "out", keep_mtp=True)


def test_a_missing_mtp_tensor_is_named(ckpt, tmp_path):
    from reference.consistency import read_safetensors, write_safetensors

    bad = tmp_path / "bad"
    shutil.copytree(ckpt["hf"], bad)
    files = sorted(bad.glob("*.safetensors"))
    assert len(files) == 1
    tensors = read_safetensors(files[0])
    del tensors["mtp.fc.weight"]
    write_safetensors(files[0], tensors, {"format": "pt"})
    with pytest.raises(_lily.LilyError, match="missing tensor 'mtp.fc.weight'"):
        _lily.Engine(str(bad), device="cpu")


# ---- generate(speculative="mtp") --------------------------------------------------------------

def repeating_checkpoint(path, head_attention: float = 0.0):
    """A checkpoint whose greedy output repeats its last token and whose MTP head drafts exactly
    that: every residual branch's output projection is zero (h stays the embedding), lm_head is
    the embedding table (a row's own dot product wins), and the head's fc passes the embedding
    half through. So every draft is accepted; with head_attention, the head's o_proj is kept,
    scaled by it, and its attention over the positions makes some drafts wrong."""
    from reference.consistency import Tensor, read_safetensors, write_safetensors

    hf = synthetic.write_checkpoint(path, layout="hf", seed=SEED, mtp=True)
    (f,) = hf.glob("*.safetensors")
    t = read_safetensors(f)
    zero = ("o_proj.weight", "out_proj.weight", "down_proj", "down_proj.weight")
    head_o = "mtp.layers.0.self_attn.o_proj.weight"
    for name, x in list(t.items()):
        if name.endswith(zero) and not (head_attention and name == head_o):
            t[name] = Tensor(x.dtype, x.shape, bytes(len(x.data)))
    if head_attention:
        t[head_o] = Tensor.from_array("BF16", (t[head_o].floats() * head_attention).view(np.uint32) >> 16)
    t["lm_head.weight"] = t["model.language_model.embed_tokens.weight"]
    H = t["mtp.fc.weight"].shape[0]
    t["mtp.fc.weight"] = Tensor.from_array("BF16", np.hstack([np.eye(H), np.zeros((H, H))]).astype(np.float32)
                                           .view(np.uint32) >> 16)
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight"):
        t[name] = Tensor(t[name].dtype, t[name].shape, bytes(len(t[name].data)))  # zero-centred: x 1
    write_safetensors(f, t, {"format": "pt"})
    return hf


@pytest.fixture(scope="module")
def models(ckpt, tmp_path_factory):
    import lily

    rep = repeating_checkpoint(tmp_path_factory.mktemp("repeat") / "ckpt")
    mixed = repeating_checkpoint(tmp_path_factory.mktemp("mixed") / "ckpt", head_attention=10.0)
    return {"random": lily.Model.load(str(ckpt["mlx"]), device="cpu", mtp=True),
            "repeat": lily.Model.load(str(rep), device="cpu", mtp=True),
            "mixed": lily.Model.load(str(mixed), device="cpu", mtp=True)}


@pytest.mark.parametrize("name", ["random", "repeat", "mixed"])
@pytest.mark.parametrize("drafts", [1, 2, 3, "auto"])
@pytest.mark.parametrize("max_tokens", [1, 2, 6, 37])
def test_speculative_generate_is_plain_greedy(models, name, drafts, max_tokens):
    m = models[name]
    want = m.generate(PROMPT.tolist(), max_tokens=max_tokens, ignore_eos=True)
    got = m.generate(PROMPT.tolist(), max_tokens=max_tokens, ignore_eos=True, speculative="mtp",
                     draft_tokens=drafts)
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    if drafts == "auto":
        return
    assert got.rounds >= (max_tokens - 1 + drafts) // (drafts + 1)
    assert got.draft_tokens <= drafts * got.rounds and 0 <= got.accepted_tokens <= got.draft_tokens
    if name == "repeat" and got.draft_tokens:
        assert got.draft_acceptance == 1.0
    if name == "repeat" and max_tokens == 37:  # 36 after the first: whole rounds at 1-3 drafts
        assert got.tokens_per_round == drafts + 1  # every round keeps its drafts and one more


@pytest.mark.parametrize("name", ["random", "repeat", "mixed"])
@pytest.mark.parametrize("end", ["stop id", "context"])
def test_speculation_ends_where_plain_decoding_does(models, name, end):
    """A stop id the plain output reaches, or a context that ends mid-round; the speculative
    run is streamed piece by piece (it pauses at the read-ahead bound and resumes); both are
    continued afterwards."""
    m = models[name]
    plain = m.generate(PROMPT.tolist(), max_tokens=60, ignore_eos=True).token_ids
    kwargs = {"stop_token_ids": [plain[len(plain) // 2]]} if end == "stop id" else {}
    context = None if end == "stop id" else len(PROMPT) + 23

    def run(speculative, stream):
        s = m.new_session(context)
        out = s.generate(PROMPT.tolist(), max_tokens=60, ignore_eos=True, speculative=speculative, stream=stream,
                         **kwargs)
        pieces = list(out) if stream else [out]
        reason = pieces[-1].finish_reason
        more = s.generate(max_tokens=5, ignore_eos=True, speculative=speculative).token_ids
        return sum((p.token_ids for p in pieces), []) + more, reason, s.tokens

    assert run("mtp", True) == run(None, False)


def test_rounds_keep_some_drafts(models):
    """The mixed head's drafts are right some of the time: rounds keep 1 to k of them, and
    the tokens stay plain greedy decoding's."""
    m = models["mixed"]
    want = m.generate(PROMPT.tolist(), max_tokens=100, ignore_eos=True)
    got = m.generate(PROMPT.tolist(), max_tokens=100, ignore_eos=True, speculative="mtp", draft_tokens=3)
    assert got.token_ids == want.token_ids
    assert 0.1 < got.draft_acceptance < 0.9 and 1.3 < got.tokens_per_round < 3.7


def test_speculation_stops_at_stop_strings(models):
    m = models["random"]
    plain = m.generate(PROMPT.tolist(), max_tokens=40, ignore_eos=True)
    stop = plain.text[len(plain.text) // 2:][:3]
    want = m.generate(PROMPT.tolist(), max_tokens=40, ignore_eos=True, stop=stop)
    got = m.generate(PROMPT.tolist(), max_tokens=40, ignore_eos=True, stop=stop, speculative="mtp")
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")


def test_speculative_generate_refuses_what_it_cannot_do(models, ckpt):
    import lily

    m = models["random"]
    with pytest.raises(lily.LilyError, match="temperature must be"):
        m.generate(PROMPT.tolist(), max_tokens=4, temperature=-1.0, speculative="mtp")
    with pytest.raises(lily.LilyError, match="draft_tokens must be an integer in \\[1, 3\\] or 'auto', got 4"):
        m.generate(PROMPT.tolist(), max_tokens=4, speculative="mtp", draft_tokens=4)
    with pytest.raises(lily.LilyError, match="draft_tokens must be .* got 'many'"):
        m.generate(PROMPT.tolist(), max_tokens=4, speculative="mtp", draft_tokens="many")
    with pytest.raises(lily.LilyError, match="speculative must be"):
        m.generate(PROMPT.tolist(), max_tokens=4, speculative="eagle")
    with pytest.raises(lily.LilyError, match="draft_tokens needs speculative"):
        m.generate(PROMPT.tolist(), max_tokens=4, draft_tokens=2)
    plain = lily.Model.load(str(ckpt["mlx"]), device="cpu")
    with pytest.raises(lily.LilyError, match="made with the MTP head"):
        plain.generate(PROMPT.tolist(), max_tokens=4, speculative="mtp")


# ---- rejection sampling (speculative_loop.cpp) -------------------------------------------------

CHI2_999 = {26: 54.05}  # the chi-square distribution's 0.999 quantile by degrees of freedom


def chi2(counts: dict, probs: dict, n: int) -> float:
    return sum((counts.get(key, 0) - n * p) ** 2 / (n * p) for key, p in probs.items())


def sampled_tokens_match_the_model(e, drafts: int, n: int = 4000) -> int:
    """The first three tokens after a pending one (a round of two drafts and its bonus token,
    or rejections and the rounds after them), over n seeds, against the model's own joint
    distribution p(a) p(b | a) p(c | a, b) under temperature and top-k (27 outcomes): drafts
    accepted with probability p(x), a rejection resampled from p without x, the bonus token
    from p. Returns the drafts accepted."""
    base = e.new_session(64)
    e.forward(base, PROMPT)
    e.generate(base, 1, _lily.SamplingParams(), []).drain()  # a pending token: the greedy first choice
    params = _lily.SamplingParams()
    params.temperature, params.top_k = 1.5, 3

    def dist(logits):
        top = np.argsort(-logits, kind="stable")[:3]
        w = np.exp((logits[top] - logits[top[0]]) / params.temperature)
        return dict(zip(top.tolist(), (w / w.sum()).tolist()))

    first = e.new_session(64)  # the same tokens fed, the pending one included
    joint = {(): 1.0}
    frontier = {(): (first, e.forward(first, np.append(PROMPT, base.pending).astype(np.int32)))}
    for _ in range(3):
        grown = {}
        for prefix, (s, logits) in frontier.items():
            for tok, p in dist(logits).items():
                t = e.clone(s)
                grown[prefix + (tok,)] = (t, e.forward(t, np.array([tok], np.int32)))
                joint[prefix + (tok,)] = joint[prefix] * p
        frontier = grown
    joint = {k: v for k, v in joint.items() if len(k) == 3}
    counts, accepted = {}, 0
    for seed in range(n):
        params.seed = seed
        stream = e.generate(e.clone(base), 3, params, [], draft_tokens=drafts)
        key = tuple(stream.drain())
        counts[key] = counts.get(key, 0) + 1
        accepted += stream.speculation[2]
    assert set(counts) <= set(joint)
    assert chi2(counts, joint, n) < CHI2_999[26]
    return accepted


@pytest.mark.parametrize("name,drafts", [("repeat", 1), ("repeat", 2), ("mixed", 2), ("random", 2)])
def test_speculative_sampling_keeps_the_target_distribution(models, name, drafts):
    accepted = sampled_tokens_match_the_model(models[name]._engine, drafts)
    if name == "repeat":
        assert accepted > 800  # the acceptance branch is taken, not only resampling


def test_speculative_sampling_is_reproducible_with_a_fixed_draft_count(models):
    m = models["random"]
    runs = [m.generate(PROMPT.tolist(), max_tokens=30, temperature=1.0, top_p=0.9, seed=seed, speculative="mtp",
                       draft_tokens=2).token_ids for seed in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_greedy_with_penalties_speculates_to_the_plain_tokens(models):
    m = models["mixed"]
    kwargs = dict(max_tokens=40, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4)
    want = m.generate(PROMPT.tolist(), **kwargs).token_ids
    for k in (1, 3, "auto"):
        assert m.generate(PROMPT.tolist(), speculative="mtp", draft_tokens=k, **kwargs).token_ids == want


# ---- the adaptive draft count (src/cpp/draft_policy.h) ---------------------------------------

PLAIN_S = 1.6e-3  # a plain step; a verify step of T rows costs VERIFY_S[T], a draft of n DRAFT_S * n
GPU_VERIFY_S = [0, 1.6e-3, 2.5e-3, 3.1e-3, 3.9e-3]  # the H200's at 4K (docs/perf-log.md, section 18)
ROW_VERIFY_S = [T * PLAIN_S for T in range(5)]  # a verify as T one-token steps (the CPU executor's)
DRAFT_S = 0.17e-3


def simulate(acceptance: float, verify_s, tokens: int = 3000, seed: int = 0):
    """Drives a DraftPolicy with these costs and drafts right with this chance each (given the
    ones before right); returns the tokens a second and each round's draft count (0: a plain run)."""
    rng = np.random.default_rng(seed)
    p = _lily.DraftPolicy(3)
    out, seconds, counts = 0, 0.0, []
    while out < tokens:
        k = p.choose()
        counts.append(k)
        if k == 0:
            n = p.plain_run
            p.decoded(n, n * PLAIN_S)
            out, seconds = out + n, seconds + n * PLAIN_S
            continue
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        p.drafted(k, accepted, DRAFT_S * k, verify_s[k + 1])
        out, seconds = out + accepted + 1, seconds + DRAFT_S * k + verify_s[k + 1]
    return out / seconds, counts


def best_rate(acceptance: float, verify_s) -> float:
    """The best fixed choice's tokens a second: plain steps, or k = 1..3 drafts every round."""
    rounds = [sum(acceptance ** i for i in range(k + 1)) / (DRAFT_S * k + verify_s[k + 1]) for k in (1, 2, 3)]
    return max([1 / PLAIN_S, *rounds])


def test_the_policy_measures_plain_steps_first_and_then_probes():
    p = _lily.DraftPolicy(3)
    assert (p.choose(), p.plain_run) == (0, 8)
    p.decoded(8, 8 * PLAIN_S)
    assert p.expected_seconds(0) == pytest.approx(PLAIN_S)
    assert 1 <= p.choose() <= 3  # after a plain run, a round (the acceptance measured again)
    with pytest.raises(_lily.LilyError, match="1 to 3 drafts a round, not 4"):
        _lily.DraftPolicy(4)


@pytest.mark.parametrize("acceptance", [0.0, 0.3, 0.6, 0.8, 0.9, 1.0])
@pytest.mark.parametrize("costs", ["gpu", "rows"])
def test_the_policy_is_near_the_best_fixed_choice(acceptance, costs):
    """Within 4 % of the best of plain steps and k = 1..3 at every acceptance (with the first
    rounds' learning), so drafts that are never right cost about nothing over plain decoding,
    and a verify that costs a step a row (no gain possible) ends in plain runs."""
    verify_s = GPU_VERIFY_S if costs == "gpu" else ROW_VERIFY_S
    rate, counts = simulate(acceptance, verify_s)
    assert rate >= 0.96 * best_rate(acceptance, verify_s)
    if acceptance == 0:
        p = _lily.DraftPolicy(3)  # never right: each plain run after a probe is twice as long
        runs = []
        for _ in range(8):
            if p.choose() == 0:
                runs.append(p.plain_run)
                p.decoded(p.plain_run, p.plain_run * PLAIN_S)
            else:
                p.drafted(1, 0, DRAFT_S, verify_s[2])
        assert runs == [8, 16, 32, 64]
    if acceptance == 1.0 and costs == "gpu":
        assert counts[-20:] == [3] * 20


def test_the_choice_is_the_best_expected_rate():
    p = _lily.DraftPolicy(3)
    p.choose()
    p.decoded(8, 8 * PLAIN_S)
    for k, accepted in ((1, 1), (2, 2), (3, 1), (3, 3), (2, 0), (1, 1), (3, 2)):
        p.choose()
        p.drafted(k, accepted, DRAFT_S * k, GPU_VERIFY_S[k + 1])
    rates = [p.expected_tokens(k) / p.expected_seconds(k) for k in range(4)]
    assert p.choose() == int(np.argmax(rates))
    assert p.expected_tokens(0) == 1 and p.expected_tokens(1) < p.expected_tokens(2) < p.expected_tokens(3) < 4


def test_the_adaptive_count_is_kept_across_generate_calls(ckpt):
    """A fresh model's first speculative generate measures plain steps first (8 tokens); the
    next call, on another session, starts drafting at once."""
    import lily

    m = lily.Model.load(str(ckpt["mlx"]), device="cpu", mtp=True)
    first = m.generate(PROMPT.tolist(), max_tokens=9, ignore_eos=True, speculative="mtp")
    assert first.rounds == 0  # the first token comes from the prompt's logits, then 8 plain steps
    second = m.generate(PROMPT.tolist(), max_tokens=9, ignore_eos=True, speculative="mtp")
    assert second.rounds >= 1 and second.token_ids == first.token_ids


def test_scripted_drafts_bound_speculation(models):
    """generate's scripted drafts (the benchmarks' oracle and always-wrong drafters): the true
    continuation is always accepted, a wrong one never, and the tokens stay plain greedy's."""
    m = models["random"]
    e = m._engine
    want = m.generate(PROMPT.tolist(), max_tokens=40, ignore_eos=True).token_ids
    vocab = int(m.config["vocab_size"])
    for script, acceptance in ((want, 1.0), ([(t + 1) % vocab for t in want], 0.0)):
        for k, adaptive, slow in ((3, False, False), (2, False, False), (3, True, False), (3, False, True)):
            s = e.new_session(128)
            e.forward(s, PROMPT)
            stream = e.generate(s, 40, _lily.SamplingParams(), [], draft_tokens=k, adaptive_drafts=adaptive,
                                scripted_drafts=script)
            if slow:  # a reader behind the read-ahead bound: the stream pauses and resumes
                got = []
                for t in stream:
                    got.append(t)
                    time.sleep(0.002)
            else:
                got = stream.drain()
            assert got == want
            rounds, drafted, accepted, _ = stream.speculation
            assert rounds > 0 and accepted == acceptance * drafted, (k, adaptive, slow)
    s = e.new_session(128)
    e.forward(s, PROMPT)
    with pytest.raises(_lily.LilyError, match="token id"):
        e.generate(s, 4, _lily.SamplingParams(), [], draft_tokens=2, scripted_drafts=[vocab]).drain()


# ---- the head on CUDA (its steps: src/cuda/step/mtp_step.h) ----------------------------------

@on_gpu
@pytest.mark.parametrize("chunk", [0, 1, 5])
@pytest.mark.parametrize("layout", ["mlx", "hf"])
def test_cuda_drafts_are_the_cpus_after_any_feeding(ckpt, chunk, layout):
    """Chunk 0: one chunked prefill; 1: one-token decode steps; 5: prefill chunks of 5."""
    cpu, cuda = engine(ckpt[layout]), engine(ckpt[layout], device="cuda")
    s, last = fed(cpu, PROMPT)
    nxt = int(np.argmax(last))
    want = cpu.draft(s, nxt, 3, logits=True)
    t, _ = fed(cuda, PROMPT, chunk)
    got = cuda.draft(t, nxt, 3, logits=True)
    np.testing.assert_array_equal(got[0], want[0])
    assert rel_err(got[1], want[1]) < 3e-2  # the prefill and decode kernels' bf16 operands


@on_gpu
@pytest.mark.parametrize("keep", [1, 2, 4])
def test_cuda_keep_verified_and_snapshots_carry_the_head(ckpt, keep):
    """Verify rows are one-token steps bit for bit, so the head after verify + keep equals the
    head after feeding the kept tokens one at a time; a clone drafts as its source."""
    e = engine(ckpt["mlx"], device="cuda")
    s, last = fed(e, PROMPT)
    step = np.array([int(np.argmax(last)), 7, 99, 3], np.int32)
    t = e.clone(s)
    choice = e.verify(s, step, logits=False)
    e.keep_verified(s, keep)
    for tok in step[:keep]:
        e.forward(t, np.array([tok], np.int32))
    nxt = int(choice[keep - 1])
    want = e.draft(t, nxt, 3, logits=True)[1]
    np.testing.assert_array_equal(e.draft(s, nxt, 3, logits=True)[1], want)
    np.testing.assert_array_equal(e.draft(e.clone(s), nxt, 3, logits=True)[1], want)


@on_gpu
def test_cuda_speculative_generate_is_plain_greedy(ckpt, tmp_path):
    import lily

    paths = {"random": ckpt["mlx"], "repeat": repeating_checkpoint(tmp_path / "repeat"),
             "mixed": repeating_checkpoint(tmp_path / "mixed", head_attention=10.0)}
    for name, path in paths.items():
        m = lily.Model.load(str(path), device="cuda", mtp=True)
        for max_tokens in (1, 6, 37):
            want = m.generate(PROMPT.tolist(), max_tokens=max_tokens, ignore_eos=True)
            for k in (1, 2, 3, "auto"):
                got = m.generate(PROMPT.tolist(), max_tokens=max_tokens, ignore_eos=True, speculative="mtp",
                                 draft_tokens=k)
                assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason, (name, k)
                if name == "repeat" and got.draft_tokens:
                    assert got.accepted_tokens == got.draft_tokens, k
        if name == "repeat":  # rejection sampling from the CUDA verify's rows
            assert sampled_tokens_match_the_model(m._engine, 2) > 800
