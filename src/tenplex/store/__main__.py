"""`python -m tenplex.store [--host ...] [--port N] ...`: run a store daemon."""

import sys

from .daemon import main

sys.exit(main())
