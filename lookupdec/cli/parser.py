"""The parser and ``main``: ``lookupdec generate | simulate | index build/info/query/verify |
serve | rewrite`` (one module per command; shared options in ``options.py``).

Errors a user can cause (bad paths, bad values) print one line ``lookupdec: error: ...`` and
exit with status 2; no traceback.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from lookupdec.cli import generate, index, rewrite, serve, simulate
from lookupdec.cli.options import EXIT_USAGE, CliError


class Parser(argparse.ArgumentParser):
    """argparse's parser, its errors one line (``lookupdec: error: ...``, status 2) as every
    other usage error, not the usage screen first; the subcommands' parsers are of this class."""

    def error(self, message: str):
        sys.stderr.write(f"lookupdec: error: {self.prog}: {message} (see '{self.prog} --help')\n")
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="lookupdec",
        description="Lossless speculative decoding from lookups (prompt n-grams, caches, corpora).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress and decisions")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (generate, simulate, serve, index, rewrite):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="lookupdec: %(message)s")
    try:
        return args.func(args)
    except (CliError, ValueError) as exc:  # ModelLoadError and ParamError are ValueErrors
        print(f"lookupdec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `lookupdec ... | head`: the reader left; not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
