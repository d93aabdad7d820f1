"""Shared test setup: helper modules importable by name, and the hypothesis profiles.

Under `CI` (set by `.ci/run` and `./dev test`) hypothesis is derandomized: the same examples every run,
so a random draw cannot fail a good change. `CI= ./dev test` (CI empty) explores with random examples;
a failure found that way is kept as an explicit `@example` in its test.
"""

import os
import sys

from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "explore")
