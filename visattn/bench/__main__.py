"""``python -m visattn.bench``: the same as the ``visattn-bench`` command."""
import sys

from visattn.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
