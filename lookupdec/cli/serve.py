"""``lookupdec serve``: the OpenAI-compatible HTTP server (``lookupdec.server``)."""
from __future__ import annotations

from lookupdec.cli.options import (CliError, add_engine_options, batch_rows, check_engine_options, engine_config,
                                   engine_kwargs, non_negative_int)
from lookupdec.config import MAX_BATCH, SERVE_MAX_BATCH


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, streaming)",
        description="Serve POST /v1/completions, POST /v1/chat/completions, GET /v1/models and "
        "GET /health. Requests run in arrival order, up to --max-batch of them sharing each verify "
        "forward (continuous batching); a client that disconnects cancels its generation; the suffix "
        "cache learns across requests. Needs the server "
        'extra (pip install "lookupdec[server]"). Never downloads.',
    )
    add_engine_options(p)
    p.add_argument("--model-name", default=None, help="model id reported by /v1/models (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (8000; 0 = a free one, printed on stderr)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
                   "$LOOKUPDEC_API_KEY if set, else no key; the variable keeps the key out of `ps`)")
    p.add_argument("--max-request-bytes", type=non_negative_int, default=4 << 20, metavar="N",
                   help="larger request bodies are refused with 413 before they are read (4194304 = 4 MiB; 0 = no limit)")
    p.add_argument("--max-batch", type=batch_rows, default=SERVE_MAX_BATCH, metavar="N",
                   help=f"requests verified together in each forward, 1-{MAX_BATCH} ({SERVE_MAX_BATCH}; 1 = one at a "
                   "time); they join and leave the batch between steps, outputs unchanged; /health shows the running "
                   "batch. Models without tree masks or with sliding windows take requests one at a time whatever N")
    p.add_argument("--openapi", action="store_true",
                   help="also serve the OpenAPI schema at /openapi.json (off by default; no /docs pages)")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        from lookupdec.server import serve
    except ImportError as exc:
        raise CliError(f'serve needs the server extra: pip install "lookupdec[server]" ({exc})') from None
    check_engine_options(args)
    if not 0 <= args.port < 1 << 16:
        raise CliError(f"--port {args.port}: expected 0 to 65535")
    serve(args.model, host=args.host, port=args.port, model_name=args.model_name,
          **engine_kwargs(args, engine_config(args)), log_level="info" if args.verbose else "warning",
          api_key=args.api_key, max_request_bytes=args.max_request_bytes, openapi=args.openapi,
          max_batch=args.max_batch)
    return 0
