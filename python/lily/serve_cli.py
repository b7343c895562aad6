"""`lily serve`: the OpenAI- and Anthropic-compatible HTTP server (see docs/server.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from . import params
from .cli import _add_model_args, _add_speculative_args, _speculative


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI- and Anthropic-compatible HTTP API")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=params.PORT.parse, default=params.PORT.default,
                   help=f"{params.PORT.help} (default: {params.PORT.default})")
    p.add_argument("--api-key", default=os.environ.get("LILY_API_KEY"),
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (default: $LILY_API_KEY, else none)")
    p.add_argument("--model-name", default=None, help="name served in /v1/models (default: the directory name)")
    p.add_argument("--context", type=params.CONTEXT.parse, default=None, help=params.CONTEXT.help)
    p.add_argument("--cache-mb", type=params.CACHE_MB.parse, default=4096,
                   help=f"{params.CACHE_MB.help} (default: 4096)")
    p.add_argument("--max-queue", type=params.MAX_QUEUE.parse, default=params.MAX_QUEUE.default,
                   help=f"{params.MAX_QUEUE.help} (default: {params.MAX_QUEUE.default})")
    p.add_argument("--max-tokens-limit", type=params.MAX_TOKENS_LIMIT.parse, default=None,
                   help=params.MAX_TOKENS_LIMIT.help)
    p.add_argument("--keep-billing-header", action="store_true",
                   help="leave Claude Code's x-anthropic-billing-header line in the system prompt (by default it "
                        "is dropped: its per-request hash would defeat the prefix cache)")
    p.add_argument("--stored-responses", type=params.STORED_RESPONSES.parse, default=params.STORED_RESPONSES.default,
                   help=f"{params.STORED_RESPONSES.help} (default: {params.STORED_RESPONSES.default})")
    _add_speculative_args(p)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from .server import ServerConfig, create_app
    except ModuleNotFoundError as e:
        print(f"lily serve needs the serve extra ({e.name} is missing): pip install 'lily-infer[serve]', "
              "or pip install '.[serve]' in a checkout", file=sys.stderr)
        return 2
    from .model import Model

    _speculative(args)  # a bad flag combination, before the model loads
    config = ServerConfig(model_name=args.model_name, aliases=(args.model,), api_key=args.api_key,
                          context=args.context, cache_bytes=args.cache_mb << 20,
                          max_queue=args.max_queue, max_tokens_limit=args.max_tokens_limit,
                          stored_responses=args.stored_responses, strip_billing_header=not args.keep_billing_header,
                          speculative=args.speculative, draft_tokens=args.draft_tokens)
    model = Model.load(args.model, device=args.device, mtp=args.speculative == "mtp")
    app = create_app(model, config)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     lily: %(message)s"))
    server_log = logging.getLogger("lily.server")
    server_log.addHandler(handler)
    server_log.setLevel(args.log_level.upper())
    print(f"lily serve: {model.path} on {model.device}, http://{args.host}:{args.port}/v1", file=sys.stderr)
    _serve(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _serve(app, **config) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGTERM, SIGINT
            app.state.worker.shut_down()  # uvicorn alone would wait for open replies to finish
            super().handle_exit(sig, frame)

    Server(uvicorn.Config(app, **config)).run()
