"""``python -m orchestration.diagnose``: runs ``orchestration.diagnose.cli.main``."""
import sys

from orchestration.diagnose.cli import main

if __name__ == "__main__":
    sys.exit(main())
