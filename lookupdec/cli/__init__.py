"""``lookupdec`` command line (the console script ``lookupdec = lookupdec.cli:main``): one
module per command (``generate``, ``serve``, ``simulate``, ``index``, ``rewrite``), the parser
and ``main`` in ``parser.py``, the options the commands share in ``options.py``."""
from lookupdec.cli.options import EXIT_USAGE, CliError
from lookupdec.cli.parser import build_parser, main

__all__ = ["EXIT_USAGE", "CliError", "build_parser", "main"]
