import sys

from lookupdec.cli import main

sys.exit(main())
