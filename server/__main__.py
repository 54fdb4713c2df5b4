"""``python -m server [MODEL] [options]``: same as ``vengine serve``."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
