"""Trains lily-tiny's MTP head (docs/MODEL.md §7) by distillation from the frozen trunk.

The trunk (the shipped 4-bit lily-tiny, run by transformers in float32 on its exactly
dequantized weights, as lily's CPU executor computes it) gives h_t after its final norm
over windows of standard-library source; the head learns, from (h_t, x_{t+1}), the trunk's
own distribution at t+1 (KL), since a draft is accepted when it is the trunk's greedy
choice. The head's decoder layer is transformers' full-attention Qwen3_5MoeDecoderLayer
(the trunk's structure), initialised from the trunk's last full-attention layer.

    python3 tools/train_tiny_mtp.py WORK_DIR [--tokens 320000] [--minutes 24]
    cp WORK_DIR/lily-tiny/model-mtp.safetensors python/lily/models/lily-tiny/  # at acceptance >= 0.6

writes WORK_DIR/hf (bf16 trunk + mtp.* tensors), WORK_DIR/lily-tiny (its `lily convert
--keep-mtp`, with the shipped trunk files beside the new model-mtp.safetensors) and
WORK_DIR/train_log.json, and prints the head's first-draft acceptance on
tests/data/lily_tiny_held_out.txt as lily's engine measures it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "python/lily/models/lily-tiny"
HELD_OUT_SLICE = ROOT / "tests/data/lily_tiny_held_out.txt"
TRUNK_FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json")
sys.path.insert(0, str(ROOT / "tools"))

from train_tiny import HELD_OUT_EVERY, read_texts  # noqa: E402

# The distribution's standard library (no test suite): the kind of copy the trunk learnt from.
DISTRIBUTION_STDLIB = f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}"


def unseen_files(full: Path, distribution: Path) -> list[Path]:
    """train_tiny.corpus_files' selection under a full standard library (a source build's, with
    its test suite) less the files the distribution's copy has: Python the trunk did not
    memorise, like the held-out text (on memorised text its states give away the next tokens)."""
    return sorted(p for p in full.rglob("*.py") if "site-packages" not in p.parts and p.stat().st_size < 400_000
                  and not (distribution / p.relative_to(full)).exists())


def overlaps(text: str, slice_lines: set[str], min_shared: int = 3) -> bool:
    """Whether text shares min_shared long lines with the held-out slice, which comes from another
    Python's standard library: this one may hold other versions of its files."""
    return len(slice_lines.intersection(line.strip() for line in text.splitlines())) >= min_shared


def token_windows(texts: list[str], tok, window: int) -> np.ndarray:
    """The texts' tokens (each file followed by <|endoftext|>), cut into [n, window] windows."""
    eos = tok.token_to_id("<|endoftext|>")
    ids = [i for enc in tok.encode_batch(texts) for i in (*enc.ids, eos)]
    n = len(ids) // window
    return np.asarray(ids[: n * window], np.int64).reshape(n, window)


def trunk_states(trunk, windows: np.ndarray, batch: int = 8):
    """h_t after the trunk's final norm, float32 [n, window, H]."""
    import torch

    out = []
    with torch.inference_mode():
        for i in range(0, len(windows), batch):
            ids = torch.from_numpy(windows[i : i + batch])
            out.append(trunk.model(input_ids=ids, use_cache=False).last_hidden_state)
    return torch.cat(out)


def make_head(trunk):
    """The MTP head as torch modules named as Qwen ships it (after "mtp."), initialised from the
    trunk: its last full-attention layer, its final norm for mtp.norm, and fc = [I | I]."""
    import copy

    import torch
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

    c = trunk.config
    H = c.hidden_size

    class MtpHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            last_full = max(i for i, kind in enumerate(c.layer_types) if kind == "full_attention")
            self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(H, eps=c.rms_norm_eps)
            self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(H, eps=c.rms_norm_eps)
            self.fc = torch.nn.Linear(2 * H, H, bias=False)
            self.layers = torch.nn.ModuleList([copy.deepcopy(trunk.model.layers[last_full])])
            self.norm = copy.deepcopy(trunk.model.norm)
            with torch.no_grad():
                self.fc.weight.copy_(torch.cat([torch.eye(H), torch.eye(H)], dim=1))

        def forward(self, hidden, next_ids, position_embeddings):
            """hidden [B, T, H] (h_t), next_ids [B, T] (x_{t+1}): mtp.norm's output [B, T, H]."""
            e = self.pre_fc_norm_embedding(trunk.model.embed_tokens(next_ids))
            u = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
            return self.norm(self.layers[0](u, position_embeddings=position_embeddings))

    head = MtpHead().requires_grad_(True)  # the copies of the frozen trunk's modules train too
    head.layers[0].self_attn.config._attn_implementation = "sdpa"  # causal, without a mask
    return head


def distill_loss(head, trunk, hidden, ids, rope):
    """KL(trunk at t+1 || head at t) over rows t = 0..T-2 of the windows, and the rate at which
    the head's argmax is the trunk's."""
    import torch
    import torch.nn.functional as F

    student = trunk.lm_head(head(hidden[:, :-1], ids[:, 1:], rope)).flatten(0, 1)
    with torch.no_grad():
        teacher = F.log_softmax(trunk.lm_head(hidden[:, 1:]).flatten(0, 1), dim=-1)
    loss = F.kl_div(F.log_softmax(student, dim=-1), teacher, log_target=True, reduction="batchmean")
    agree = (student.argmax(-1) == teacher.argmax(-1)).float().mean()
    return loss, agree.item()


def write_hf(hf_dir: Path, trunk_sd: dict, head) -> None:
    """An HF-layout bf16 checkpoint: the dequantized trunk and the mtp.* tensors, with the shipped
    config.json, whose quantization block makes `lily convert` store the head as the shipped
    config reads it (4-bit, group 64; its router is not named there, so 4-bit too)."""
    import torch
    from safetensors.torch import save_file

    hf_dir.mkdir(parents=True)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in trunk_sd.items()}
    tensors.update({"mtp." + k: v.to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()})
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in TRUNK_FILES[1:]:
        shutil.copyfile(TINY / name, hf_dir / name)


def first_draft_acceptance(directory: Path, ids: list[int], positions: int) -> float:
    """Teacher-forced on ids: the rate at which the head's first draft after x_{t+1} (the session
    holding x_0..x_t) is the trunk's greedy choice after x_{t+1}."""
    from lily import _lily

    e = _lily.Engine(str(directory), "cpu")
    e.use_mtp = True
    s = e.new_session(positions + 2)
    e.forward(s, np.asarray(ids[:1], np.int32))
    hits = 0
    for t in range(positions):
        draft = e.draft(s, ids[t + 1], 1)[0]
        hits += int(draft == np.argmax(e.forward(s, np.asarray(ids[t + 1 : t + 2], np.int32))))
    return hits / positions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work_dir")
    ap.add_argument("--tokens", type=int, default=320_000, help="training tokens (trunk states kept in memory)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="windows a step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--minutes", type=float, default=24.0, help="training wall time (the LR schedule spans it)")
    ap.add_argument("--positions", type=int, default=2000, help="held-out positions the engine measures")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="a full standard library (with tests)")
    ap.add_argument("--distribution-stdlib", default=DISTRIBUTION_STDLIB, help="its files are left out")
    args = ap.parse_args()
    from lily import LilyError, hub
    from lily.bench.references import dequantized_state_dict, hf_model_fp32
    from lily.convert import convert
    from lily.output import check_empty_dir

    try:
        work = check_empty_dir(args.work_dir)
    except LilyError as e:
        ap.error(str(e))
    import torch
    from tokenizers import Tokenizer

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    work.mkdir(parents=True, exist_ok=True)
    log: dict = {"args": vars(args), "steps": []}
    t0 = time.time()

    slice_text = HELD_OUT_SLICE.read_text()
    slice_lines = {line.strip() for line in slice_text.splitlines() if len(line.strip()) >= 40}
    files = unseen_files(Path(args.stdlib), Path(args.distribution_stdlib))
    texts = read_texts(files)  # skips unreadable files, so the split is on the texts' order
    kept = [(i, t) for i, t in enumerate(texts) if not overlaps(t, slice_lines)]
    train = [t for i, t in kept if i % HELD_OUT_EVERY != 0]
    val = [t for i, t in kept if i % HELD_OUT_EVERY == 0]
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    train_w, val_w = token_windows(train, tok, args.window), token_windows(val, tok, args.window)
    train_w = train_w[rng.permutation(len(train_w))[: args.tokens // args.window]]
    val_w = val_w[rng.permutation(len(val_w))[:16]]
    log["corpus"] = {"root": args.stdlib, "less": args.distribution_stdlib, "files": len(texts),
                     "excluded_for_overlap": len(texts) - len(kept), "train_tokens": int(train_w.size),
                     "val_tokens": int(val_w.size)}
    print(json.dumps(log["corpus"]), flush=True)

    trunk = hf_model_fp32(hub.lily_tiny_dir()).requires_grad_(False)
    train_h, val_h = trunk_states(trunk, train_w), trunk_states(trunk, val_w)
    train_ids, val_ids = torch.from_numpy(train_w), torch.from_numpy(val_w)
    log["minutes_data"] = (time.time() - t0) / 60
    print(f"trunk states: {log['minutes_data']:.1f} min", flush=True)

    head = make_head(trunk)
    params = list(head.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    positions = torch.arange(args.window - 1)[None].expand(args.batch, -1)
    rope = trunk.model.rotary_emb(train_h[:1], positions)
    val_rope = trunk.model.rotary_emb(val_h[:1], positions[:1].expand(len(val_h), -1))

    def validate():
        head.eval()
        with torch.no_grad():
            loss, agree = distill_loss(head, trunk, val_h, val_ids, val_rope)
        head.train()
        return loss.item(), agree

    t_train, step, budget = time.time(), 0, args.minutes * 60
    head.train()
    while (elapsed := time.time() - t_train) < budget:
        # Linear warm-up over 20 steps, then cosine decay over the wall-time budget.
        lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + np.cos(np.pi * elapsed / budget))
        for group in opt.param_groups:
            group["lr"] = lr
        pick = torch.from_numpy(rng.integers(0, len(train_h), size=args.batch))
        loss, agree = distill_loss(head, trunk, train_h[pick], train_ids[pick], rope)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0:
            entry = {"step": step, "loss": loss.item(), "agree": agree, "lr": lr, "minutes": elapsed / 60}
            if step % 100 == 0:
                entry["val_loss"], entry["val_agree"] = validate()
            log["steps"].append(entry)
            print(json.dumps(entry), flush=True)
        step += 1
    log["minutes_train"] = (time.time() - t_train) / 60
    log["final"] = dict(zip(("val_loss", "val_agree"), validate()), steps=step)
    print(json.dumps(log["final"]), flush=True)

    write_hf(work / "hf", dequantized_state_dict(hub.lily_tiny_dir()), head)
    converted = convert(work / "hf", work / "converted", keep_mtp=True)
    out = work / "lily-tiny"
    out.mkdir()
    for name in TRUNK_FILES:
        shutil.copyfile(TINY / name, out / name)
    shutil.copyfile(converted / "model-mtp.safetensors", out / "model-mtp.safetensors")

    ids = tok.encode(slice_text).ids
    log["acceptance"] = first_draft_acceptance(out, ids, min(args.positions, len(ids) - 2))
    log["head_bytes"] = (out / "model-mtp.safetensors").stat().st_size
    print(f"first-draft acceptance on {min(args.positions, len(ids) - 2)} held-out positions: "
          f"{log['acceptance']:.4f}; head file {log['head_bytes']:,} bytes", flush=True)
    (work / "train_log.json").write_text(json.dumps(log, indent=2))


if __name__ == "__main__":
    main()
