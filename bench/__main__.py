"""Entry point: ``python -m bench --help``."""

import sys

from .cli import main

sys.exit(main())
