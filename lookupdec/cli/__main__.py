import sys

from lookupdec.cli.parser import main

sys.exit(main())
