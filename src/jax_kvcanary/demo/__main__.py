"""``python -m jax_kvcanary.demo``: see ``cli.py``."""

import sys

from .cli import main

sys.exit(main())
