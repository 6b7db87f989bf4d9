"""``python -m atb``: the ``atb`` command line (same as the ``atb`` script)."""

import sys

from atbcore.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
