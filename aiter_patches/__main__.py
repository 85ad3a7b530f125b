"""``python -m aiter_patches`` is the ``aiter-patches`` command."""

import sys

from .cli import main

sys.exit(main())
