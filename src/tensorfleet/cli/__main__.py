"""``python -m tensorfleet.cli``: the ``tensorfleet`` command, from a tree that was never installed (and in tests)."""

import sys

from tensorfleet.cli import main

if __name__ == "__main__":
    sys.exit(main())
