"""The `lily` command: generate, convert, synthetic checkpoints, info (and bench/serve/chat)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings

from ._version import __version__

DEFAULT_MODEL = "lily-tiny"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=DEFAULT_MODEL,
                   help=f"checkpoint directory, built-in name or Hub repo id (default: {DEFAULT_MODEL})")
    p.add_argument("--device", default="auto",
                   help="auto, cpu, cuda, cuda:N or metal-emulator (the Metal kernels emulated on the CPU: slow; "
                        "default: auto)")


def _add_sampling_args(p: argparse.ArgumentParser, **defaults) -> None:
    """One flag per sampling parameter of lily.params: the API's keywords, ranges and defaults
    (`defaults` overrides some, e.g. max_tokens for chat)."""
    from . import params

    for param in params.SAMPLING:
        flags = ("-n", param.flag) if param is params.MAX_TOKENS else (param.flag,)
        default = defaults.get(param.name, param.default)
        shown = "" if default is None else f" (default: {default})"
        p.add_argument(*flags, type=param.parse, default=default, dest=param.name,
                       help=f"{param.help}; {param.rule}{shown}")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _add_think_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="let the model think before answering, or not (default: the chat template's; "
                        "Qwen3.5/3.6 think), as in the API and the server")


def _sampling(args) -> dict:
    from . import params

    return {**{p.name: getattr(args, p.name) for p in params.SAMPLING}, "stop": args.stop}


def cmd_generate(args) -> int:
    from ._lily import LilyError
    from .model import Model

    if args.think is not None and not args.chat:
        raise LilyError(f"--{'' if args.think else 'no-'}think needs --chat (thinking is part of the chat template)")
    model = Model.load(args.model, device=args.device, mtp=args.speculative == "mtp")
    prompt = args.prompt
    if prompt is None:
        if sys.stdin.isatty():
            raise LilyError("give a prompt (an argument, or '-' or a pipe for standard input)")
        prompt = _read_stdin()
    elif prompt == "-":
        prompt = _read_stdin()
    kwargs = {**_sampling(args), **_speculative(args)}
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
          f"decode {len(r.token_ids)} tokens at {r.decode_tokens_per_s:,.1f} tok/s | finish: {r.finish_reason}"
          + _speculation_summary(args, r), file=sys.stderr)
    return 0


def _add_speculative_args(p) -> None:
    from . import params

    p.add_argument("--speculative", choices=["mtp"], default=None,
                   help="speculative decoding with the checkpoint's MTP head (the same tokens when greedy, the same "
                        "distribution when sampling; faster when its drafts are accepted)")
    p.add_argument("--draft-tokens", type=params.parse_draft_tokens, default=None,
                   help=f"{params.DRAFT_TOKENS.help}; {params.DRAFT_TOKENS.rule}, or '{params.AUTO_DRAFTS}' (the "
                        "default: each round's count from the measured acceptance and costs)")


def _speculation_summary(args, r) -> str:
    """The status line's speculative part: acceptance, tokens a round, and the tokens that came
    from plain steps (the first one, chosen from the prompt's logits, is neither)."""
    from .params import AUTO_DRAFTS

    if not args.speculative:
        return ""
    if not r.rounds:
        adaptive = args.draft_tokens in (None, AUTO_DRAFTS)
        return " | no speculative round" + (" (adaptive drafting ran plain steps)" if adaptive else "")
    plain = len(r.token_ids) - 1 - r.round_tokens
    return (f" | drafts accepted {r.accepted_tokens}/{r.draft_tokens}, {r.tokens_per_round:.2f} tokens a round"
            + (f", {plain} by plain steps" if plain else ""))


def _speculative(args) -> dict:
    """generate's speculative keywords from --speculative / --draft-tokens (none without them)."""
    from ._lily import LilyError

    if args.draft_tokens is not None and not args.speculative:
        raise LilyError("--draft-tokens needs --speculative mtp")
    return {"speculative": args.speculative, "draft_tokens": args.draft_tokens} if args.speculative else {}


def _read_stdin() -> str:
    from ._lily import LilyError

    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LilyError(f"standard input is not UTF-8 text (byte {e.start} is not part of a character)") from e


def cmd_convert(args) -> int:
    from .convert import convert

    out = convert(args.hf_dir, args.out_dir, keep_mtp=args.keep_mtp)
    print(f"wrote {out}")
    return 0


def cmd_synthetic(args) -> int:
    from . import synthetic
    from .output import check_empty_dir

    if not args.force:
        check_empty_dir(args.out_dir, allow="--force")
    config = synthetic.config_35b() if args.size == "35b" else synthetic.tiny_config()
    out = synthetic.write_checkpoint(args.out_dir, config=config, layout=args.layout, seed=args.seed,
                                     mtp=args.mtp, overwrite=args.force)
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
        print(f"  MTP head: {'yes (speculative decoding: --speculative mtp)' if model.has_mtp else 'no'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import params

    parser = argparse.ArgumentParser(prog="lily", description="Fast local inference for Qwen3.5/3.6 MoE models")
    parser.add_argument("--version", action="version", version=f"lily {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt, streamed")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("prompt", nargs="?", default=None, help="the prompt; '-' or a pipe reads standard input")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template as a user message (default: raw text)")
    _add_think_arg(g)
    _add_speculative_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="HF bf16 checkpoint -> MLX affine 4-bit checkpoint")
    c.add_argument("hf_dir")
    c.add_argument("out_dir")
    c.add_argument("--keep-mtp", action="store_true",
                   help="also write the MTP head, into model-mtp.safetensors (the trunk's files are unchanged)")
    c.set_defaults(func=cmd_convert)

    s = sub.add_parser("synthetic", help="write a random-weight checkpoint (tests, benchmarks)")
    s.add_argument("out_dir")
    s.add_argument("--size", choices=["tiny", "35b"], default="tiny")
    s.add_argument("--layout", choices=["mlx", "hf"], default="mlx")
    s.add_argument("--seed", type=params.WEIGHT_SEED.parse, default=params.WEIGHT_SEED.default,
                   help=f"{params.WEIGHT_SEED.help}; {params.WEIGHT_SEED.rule} (default: 0)")
    s.add_argument("--force", action="store_true",
                   help="replace a checkpoint already in OUT_DIR (default: refuse a directory that holds files)")
    s.add_argument("--mtp", action="store_true", help="with an MTP head (random, as the trunk)")
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
        with warnings.catch_warnings():  # restores the handler when done (main may run in-process)
            warnings.showwarning = _show_warning
            return args.func(args)
    except LilyError as e:
        return _error(e)
    except BrokenPipeError:  # the reader left (`lily generate ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 128 + signal.SIGPIPE
    except OSError as e:  # a path the user gave that cannot be read or written
        return _error(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else e)
    except KeyboardInterrupt:
        return 130


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    from .params import LilyWarning

    if issubclass(category, LilyWarning):
        print(f"lily: warning: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _error(message) -> int:
    print(f"lily: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
