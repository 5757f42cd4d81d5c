"""``lookupdec serve``: the OpenAI-compatible HTTP server (``lookupdec.server``)."""
from __future__ import annotations

import argparse
import math

from lookupdec.cli.options import (CliError, add_engine_options, batch_rows, check_engine_options, engine_config,
                                   engine_kwargs, non_negative_int)
from lookupdec.config import MAX_BATCH, SERVE_GRACE_S, SERVE_MAX_BATCH


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
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (127.0.0.1; an IPv6 one such as ::1 with or without brackets)")
    p.add_argument("--port", type=int, default=8000, help="port (8000; 0 = a free one, printed on stderr)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
                   "$LOOKUPDEC_API_KEY if set, else no key; the variable keeps the key out of `ps`)")
    p.add_argument("--max-request-bytes", type=non_negative_int, default=4 << 20, metavar="N",
                   help="larger request bodies are refused with 413 before they are read (4194304 = 4 MiB; 0 = no limit)")
    p.add_argument("--max-batch", type=batch_rows, default=SERVE_MAX_BATCH, metavar="N",
                   help=f"requests verified together in each forward, 1-{MAX_BATCH} ({SERVE_MAX_BATCH}; 1 = one at a "
                   "time); they join and leave the batch between steps, outputs unchanged; /health shows the running "
                   "batch. Models without tree masks or with sliding windows take requests one at a time whatever "
                   "N. The K/V memory N rows reserve for --max-nodes nodes each must fit the device (checked at start)")
    p.add_argument("--grace", type=seconds, default=SERVE_GRACE_S, metavar="SECONDS",
                   help=f"shutdown grace period ({SERVE_GRACE_S:g} s): on SIGTERM or Ctrl+C new requests get a 503, "
                   "those in flight get this long to finish, then end with a 503 error (a stream: an error event, "
                   "then [DONE]); a second signal ends the grace period at once. The server exits once none is "
                   "left (status 0 after SIGTERM)")
    p.add_argument("--openapi", action="store_true",
                   help="also serve the OpenAPI schema at /openapi.json (off by default; no /docs pages)")
    p.set_defaults(func=run)


def seconds(text: str) -> float:
    """``--grace``'s value: a finite number of seconds, at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


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
          max_batch=args.max_batch, grace=args.grace)
    return 0
