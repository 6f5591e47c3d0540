"""``python -m orchestration.experiments``: see orchestration.experiments.cli."""
import sys

from orchestration.experiments.cli import main

sys.exit(main())
