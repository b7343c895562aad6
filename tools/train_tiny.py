"""Trains lily-tiny: a small qwen3_5_moe model on the Python standard library's source.

The model has the real structure (3 Gated DeltaNet layers to 1 gated-attention layer,
GQA, partial RoPE, zero-centred norms, top-k routed experts plus the sigmoid-gated
shared expert) and is trained with transformers' Qwen3_5MoeForCausalLM. The text is
the .py files of the running Python's standard library (PSF licence, which allows
shipping derived weights); every 20th file is held out for perplexity.

    python3 tools/train_tiny.py OUT_DIR [--steps 1500] [--device cuda]

writes OUT_DIR/hf (bf16 checkpoint + tokenizer) and OUT_DIR/train_log.json; then
`lily convert OUT_DIR/hf OUT_DIR/lily-tiny` makes the shipped 4-bit model.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VOCAB_SIZE = 4096
HELD_OUT_EVERY = 20


def corpus_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.stat().st_size < 400_000)
    return files


def read_texts(files: list[Path]) -> list[str]:
    texts = []
    for p in files:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def model_config(vocab_size: int, eos_id: int) -> dict:
    return {
        "model_type": "qwen3_5_moe_text",
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 64,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "dtype": "bfloat16",
    }


def batches(tokens: np.ndarray, seq: int, batch: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
        yield np.stack([tokens[s : s + seq + 1] for s in starts])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop after this many steps of the --steps schedule (reproduces a run that stopped early)")
    ap.add_argument("--max-minutes", type=float, default=14.0, help="stop early past this wall time")
    args = ap.parse_args()
    from lily import LilyError
    from lily.output import check_empty_dir

    try:  # before the training, not after it
        check_empty_dir(args.out_dir)
    except LilyError as e:
        ap.error(str(e))

    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    t_start = time.time()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    out = Path(args.out_dir)
    hf_dir = out / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)

    files = corpus_files()
    train_files = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY != 0]
    held_files = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == 0]
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    tok = train_tokenizer(train_texts)
    eos = tok.token_to_id("<|endoftext|>")

    def encode(texts):
        ids = []
        for enc in tok.encode_batch(texts):
            ids.extend(enc.ids)
            ids.append(eos)
        return np.asarray(ids, dtype=np.int64)

    train_ids, held_ids = encode(train_texts), encode(held_texts)
    print(f"corpus: {len(train_files)} train files ({len(train_ids):,} tokens), "
          f"{len(held_files)} held-out files ({len(held_ids):,} tokens)", flush=True)

    cfg_dict = model_config(tok.get_vocab_size(), eos)
    config = Qwen3_5MoeTextConfig(**{k: v for k, v in cfg_dict.items() if k not in ("model_type", "architectures", "dtype")})
    model = Qwen3_5MoeForCausalLM(config).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def lr_at(step):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    def held_out_loss(n_batches=16):
        model.eval()
        r = np.random.default_rng(1234)
        losses = []
        with torch.no_grad(), torch.autocast(args.device, dtype=torch.bfloat16):
            for _ in range(n_batches):
                b = torch.from_numpy(next(batches(held_ids, args.seq, 8, r))).to(args.device)
                losses.append(_lm_loss(model, b))
        model.train()
        return float(np.mean(losses))

    log = {"config": cfg_dict, "params": n_params, "steps": [], "seed": args.seed,
           "corpus": {"root": sysconfig.get_paths()["stdlib"], "train_files": len(train_files),
                      "held_out_files": len(held_files), "train_tokens": int(len(train_ids)),
                      "held_out_tokens": int(len(held_ids))}}
    data = batches(train_ids, args.seq, args.batch, rng)
    model.train()
    step = 0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        b = torch.from_numpy(next(data)).to(args.device)
        with torch.autocast(args.device, dtype=torch.bfloat16):
            out_ = model(input_ids=b[:, :-1])
            loss = torch.nn.functional.cross_entropy(out_.logits.float().flatten(0, 1), b[:, 1:].flatten())
            total = loss + (config.router_aux_loss_coef * out_.aux_loss if out_.aux_loss is not None else 0)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            entry = {"step": step, "loss": loss.item(), "lr": lr_at(step), "minutes": (time.time() - t_start) / 60}
            if step % 250 == 0 or step == args.steps - 1:
                entry["held_out_loss"] = held_out_loss()
            log["steps"].append(entry)
            print(json.dumps(entry), flush=True)
        if args.stop_after is not None and step + 1 >= args.stop_after:
            break
        if (time.time() - t_start) / 60 > args.max_minutes:
            print(f"stopping at step {step}: time budget reached", flush=True)
            break

    final = held_out_loss(64)
    log["final"] = {"step": step, "train_loss": loss.item(), "held_out_loss": final,
                    "held_out_perplexity": math.exp(final), "minutes": (time.time() - t_start) / 60}
    print(json.dumps(log["final"]), flush=True)

    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(hf_dir, safe_serialization=True, max_shard_size="12MB")
    cfg_on_disk = json.loads((hf_dir / "config.json").read_text())
    cfg_on_disk["output_router_logits"] = False
    (hf_dir / "config.json").write_text(json.dumps(cfg_on_disk, indent=2))
    tok.save(str(hf_dir / "tokenizer.json"))
    template = (Path(__file__).resolve().parent.parent / "python/lily/templates/qwen3_chat_template.jinja")
    tok_config = {"eos_token": "<|endoftext|>", "bos_token": None, "model_max_length": cfg_dict["max_position_embeddings"],
                  "tokenizer_class": "PreTrainedTokenizerFast"}
    if template.exists():
        tok_config["chat_template"] = template.read_text()
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}, indent=2))
    (out / "held_out_files.txt").write_text("\n".join(str(f) for f in held_files))
    # A slice of held-out text for consistency tests on machines with another stdlib.
    (out / "held_out_sample.txt").write_text("".join(held_texts)[:24_000])
    (out / "train_log.json").write_text(json.dumps(log, indent=2))


def _lm_loss(model, b):
    import torch

    logits = model(input_ids=b[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten()).item()


if __name__ == "__main__":
    main()
