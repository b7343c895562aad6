"""The `lily` command: generate, convert, synthetic checkpoints, info (and bench/serve/chat)."""

from __future__ import annotations

import argparse
import sys

from ._version import __version__

DEFAULT_MODEL = "lily-tiny"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=DEFAULT_MODEL,
                   help=f"checkpoint directory, built-in name or Hub repo id (default: {DEFAULT_MODEL})")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty, seed=args.seed, stop=args.stop)


def cmd_generate(args) -> int:
    from ._lily import LilyError
    from .model import Model

    model = Model.load(args.model, device=args.device)
    prompt = args.prompt
    if prompt is None:
        if sys.stdin.isatty():
            raise LilyError("give a prompt (an argument, or '-' or a pipe for standard input)")
        prompt = sys.stdin.read()
    elif prompt == "-":
        prompt = sys.stdin.read()
    if args.think and not args.chat:
        raise LilyError("--think needs --chat (thinking is part of the chat template)")
    kwargs = _sampling(args)
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": prompt}]
        kwargs["enable_thinking"] = args.think
    else:
        kwargs["prompt"] = prompt
    stream = model.generate(stream=True, **kwargs)
    for piece in stream:
        sys.stdout.write(piece.text)
        sys.stdout.flush()
    r = stream.result
    sys.stdout.write("\n")
    print(f"[{model.device}] prefill {r.prompt_tokens} tokens at {r.prefill_tokens_per_s:,.1f} tok/s | "
          f"decode {len(r.token_ids)} tokens at {r.decode_tokens_per_s:,.1f} tok/s | finish: {r.finish_reason}",
          file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from .convert import convert

    out = convert(args.hf_dir, args.out_dir)
    print(f"wrote {out}")
    return 0


def cmd_synthetic(args) -> int:
    from . import synthetic
    from .output import check_empty_dir

    if not args.force:
        check_empty_dir(args.out_dir, allow="--force")
    config = synthetic.config_35b() if args.size == "35b" else synthetic.tiny_config()
    out = synthetic.write_checkpoint(args.out_dir, config=config, layout=args.layout, seed=args.seed,
                                     overwrite=args.force)
    print(f"wrote {out}")
    return 0


def cmd_info(args) -> int:
    from . import _lily, hub
    from .model import Model

    print(f"lily {__version__}; devices: {', '.join(_lily.available_devices())}; "
          f"CPU threads: {_lily.num_threads()}")
    print("built-in models:")
    for name, what in hub.builtin_models().items():
        print(f"  {name}: {what}")
    if args.model:
        model = Model.load(args.model, device=args.device)
        for k, v in model.config.items():
            if k != "layer_types":
                print(f"  {k}: {v}")
        print(f"  weights: {model._engine.weight_bytes / 1e9:.3f} GB ({model._engine.source_layout} layout), "
              f"device {model.device}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lily", description="Fast local inference for Qwen3.5/3.6 MoE models")
    parser.add_argument("--version", action="version", version=f"lily {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt, streamed")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("prompt", nargs="?", default=None, help="the prompt; '-' or a pipe reads standard input")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template as a user message (default: raw text)")
    g.add_argument("--think", action=argparse.BooleanOptionalAction, default=False,
                   help="let the model think first (chat only; default: off)")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="HF bf16 checkpoint -> MLX affine 4-bit checkpoint")
    c.add_argument("hf_dir")
    c.add_argument("out_dir")
    c.set_defaults(func=cmd_convert)

    s = sub.add_parser("synthetic", help="write a random-weight checkpoint (tests, benchmarks)")
    s.add_argument("out_dir")
    s.add_argument("--size", choices=["tiny", "35b"], default="tiny")
    s.add_argument("--layout", choices=["mlx", "hf"], default="mlx")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--force", action="store_true",
                   help="replace a checkpoint already in OUT_DIR (default: refuse a directory that holds files)")
    s.set_defaults(func=cmd_synthetic)

    i = sub.add_parser("info", help="devices, built-in models, and a model's configuration")
    i.add_argument("-m", "--model", default=None)
    i.add_argument("--device", default="auto")
    i.set_defaults(func=cmd_info)

    for name in ("bench", "serve", "chat"):
        _register_optional(sub, name)
    return parser


def _register_optional(sub, name: str) -> None:
    """Subcommands that live in their own modules register themselves via add_parser(sub)."""
    import importlib

    try:
        module = importlib.import_module(f"lily.{name}_cli")
    except ModuleNotFoundError as e:
        if e.name != f"lily.{name}_cli":
            raise
        return
    module.add_parser(sub)


def main(argv: list[str] | None = None) -> int:
    from ._lily import LilyError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except LilyError as e:
        print(f"lily: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
