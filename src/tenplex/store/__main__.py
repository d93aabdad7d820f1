"""`python -m tenplex.store [--host ...] [--port N] ...`: run a store daemon."""

import sys

from .main import main

sys.exit(main())
