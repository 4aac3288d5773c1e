"""`python -m k26jax <command>`: see k26jax/cli.py."""

import sys

from k26jax.cli import main

sys.exit(main())
