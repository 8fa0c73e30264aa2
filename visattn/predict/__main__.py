"""``python -m visattn.predict``: the same as the ``visattn-predict`` command."""
import sys

from visattn.predict.cli import main

if __name__ == "__main__":
    sys.exit(main())
