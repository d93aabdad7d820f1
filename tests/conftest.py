"""Shared test setup: helper modules importable by name, and the hypothesis profiles.

Under `CI` (set by `.ci/run` and `./dev test`) hypothesis is derandomized: the same examples every run,
so a random draw cannot fail a good change. `CI= ./dev test` (CI empty) explores with random examples;
a failure found that way is kept as an explicit `@example` in its test.
"""

import os
import sys
import tempfile

import pytest
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))
# jobs' records of their stores (transformer/jobrecord.py) go to a directory of this run, never the home
# of whoever runs the tests; each test gets its own below, so a job name reused with new stores is new
os.environ["TENPLEX_STATE_DIR"] = tempfile.mkdtemp(prefix="tenplex-test-jobs-")

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "explore")


@pytest.fixture(autouse=True)
def own_job_records(monkeypatch, tmp_path_factory):
    """Each test its own record directory (processes it starts inherit it)."""
    monkeypatch.setenv("TENPLEX_STATE_DIR", str(tmp_path_factory.mktemp("jobs")))


@pytest.fixture(autouse=True)
def no_store_outlives_a_test(request):
    """A `tenplex run` that failed, hung or was killed leaves its stores up for a rerun, with their shared
    memory: after every test that had a `tmp_path`, the stores logged under it that still answer as the
    process they logged are stopped (they remove their shared memory on SIGTERM)."""
    yield
    tmp = request.node.funcargs.get("tmp_path")
    if tmp is not None:
        from fault_cases import stop_stores

        stop_stores(tmp)


@pytest.fixture(scope="module")
def store():
    """One store daemon per test module (512 MiB; a module may define its own `store` instead)."""
    yield from serve()


def serve(extra: list[str] | None = None):
    """A store daemon for a fixture to yield: the client finds it is on the same host by itself, and
    stopping it leaves no shared memory behind."""
    from tenplex.store import start_store
    from tenplex.store.tmpfs import host_path

    sp = start_store(memory_limit="512MiB", extra=extra)
    yield sp
    assert sp.client().is_local  # same host: found out by the client itself, not forced
    assert sp.stop() == 0
    assert not os.path.exists(sp.shm_dir) and not os.path.exists(host_path(sp.shm_dir))
