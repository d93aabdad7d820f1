"""PyTorch's own DCP tests, run twice: on DCP's file system, and on tenplex's stores.

    python scripts/torch_dcp_suite.py [--tests DIR] [--json OUT] [-k EXPR]

The tests (PyTorch's `test/distributed/checkpoint` files that run on CPU with gloo; tests/third_party/
torch_dcp/README.md says which and from where) run unchanged with pytest. The stores variant starts a real
store daemon and puts tests/torch_dcp_swap on the path of every process, whose `sitecustomize` swaps DCP's
file-system storage for `StoreWriter`/`StoreReader`. Prints the pass counts per variant and file, and every
test that passes on the file system but not on the stores; exits 1 if there is one.

This module is also the pytest plugin of both runs (`-p torch_dcp_suite`): a test that PyTorch gates on
more accelerators than the machine has (`skip_if_lt_x_gpu(n)`, an NCCL-only test class) is skipped at
collection, as it would skip anyway, without first spawning its ranks (seconds each on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests" / "third_party" / "torch_dcp"
SWAP = ROOT / "tests" / "torch_dcp_swap"


_GATE = re.compile(r"^\s*@skip_if_lt_x_gpu\((\d+)\)", re.M)  # without allow_cpu: accelerators only


def _needs_gpus(item: Any) -> int:
    """How many accelerators a collected test needs (0: none), read off its decorators and its class's
    backend (an NCCL-only class needs one at least)."""
    backend = inspect.getattr_static(getattr(item, "cls", None), "backend", None)
    if isinstance(backend, property):
        try:
            if backend.fget(None) == "nccl":
                return 1
        except Exception:  # a backend that depends on the instance: not NCCL-only
            pass
    try:
        source = inspect.getsource(inspect.unwrap(item.obj))
    except (AttributeError, OSError, TypeError):
        return 0
    return max((int(n) for n in _GATE.findall(source.split("def ", 1)[0])), default=0)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    import pytest
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if (n := _needs_gpus(item)) > have:
            item.add_marker(pytest.mark.skip(reason=f"needs {n} GPUs (skipped at collection, not spawned)"))


def outcomes(report: Path) -> dict[str, str]:
    """Each test's outcome from pytest's JUnit XML: passed, failed or skipped."""
    out = {}
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[name] = (
            "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        )
    return out


def run(tests: Path, stores: bool, keyword: str | None, per_test: float) -> dict[str, str]:
    """One variant in a pytest process of its own (PyTorch's rules, none of this project's), every test
    run (no -x) under a timeout of its own."""
    with tempfile.TemporaryDirectory(prefix="tenplex-dcp-suite-") as tmp:
        ini, report = Path(tmp, "pytest.ini"), Path(tmp, "report.xml")
        ini.write_text("[pytest]\n")
        env = {**os.environ, "TENPLEX_STATE_DIR": tmp, "TENPLEX_DCP_SWAP": "1" if stores else "0"}
        paths = [str(ROOT / "src"), str(ROOT / "scripts"), *([str(SWAP)] if stores else [])]
        env["PYTHONPATH"] = os.pathsep.join(p for p in [*paths, env.get("PYTHONPATH", "")] if p)
        cmd = [sys.executable, "-m", "pytest", str(tests), "-c", str(ini), "--rootdir", str(tests),
               "-p", "no:cacheprovider", "-p", "torch_dcp_suite", "-q", f"--junitxml={report}",
               f"--timeout={per_test:g}"]  # fmt: skip
        if keyword:
            cmd += ["-k", keyword]
        with _store(stores) as url:
            if url:
                env["TENPLEX_STORE"] = url
            subprocess.run(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL)
        if not report.exists():
            raise SystemExit(f"torch_dcp_suite: pytest wrote no report for {tests} (no test files there?)")
        return outcomes(report)


@contextlib.contextmanager
def _store(stores: bool) -> Iterator[str | None]:
    """A real store daemon for the stores variant, for as long as it runs."""
    if not stores:
        yield None
        return
    from tenplex.store import start_store

    with start_store() as store:
        yield store.url


def compare(fs: dict[str, str], st: dict[str, str]) -> dict:
    """The counts (in all and per file), and the tests the file system passes that the stores do not."""
    kinds = ("passed", "failed", "skipped")
    runs = (("file_system", fs), ("stores", st))
    count = {v: {k: sum(o == k for o in res.values()) for k in kinds} for v, res in runs}
    files: dict[str, dict[str, dict[str, int]]] = {}
    for v, res in runs:
        for test, o in res.items():
            per = files.setdefault(test.split(".", 1)[0], {}).setdefault(v, dict.fromkeys(kinds, 0))
            per[o] += 1
    lost = sorted(t for t, o in fs.items() if o == "passed" and st.get(t) != "passed")
    return {"counts": count, "files": files, "fs_passed": count["file_system"]["passed"], "lost": lost}


def report(res: dict, st: dict[str, str]) -> None:
    """The counts per file and in all, file system against stores, and what the stores lost."""
    print(f"{'file':42} {'file system (pass/fail/skip)':>30} {'stores':>12}")
    for name, per in sorted(res["files"].items()):
        cells = ["/".join(str(c[k]) for k in ("passed", "failed", "skipped")) for c in per.values()]
        print(f"{name:42} {cells[0]:>30} {cells[-1]:>12}")
    for variant, c in res["counts"].items():
        print(f"{variant:12} passed {c['passed']:3}  failed {c['failed']:3}  skipped {c['skipped']:3}")
    ok = res["fs_passed"] - len(res["lost"])
    print(f"stores pass {ok} of the {res['fs_passed']} tests the file system passes")
    for name in res["lost"]:
        print(f"  not on the stores: {name} ({st.get(name, 'not run')})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tests", type=Path, default=TESTS, help="folder of PyTorch's test files (default: %(default)s)"
    )
    ap.add_argument("--json", type=Path, help="also write the outcomes and counts here")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression: run only the matching tests")
    ap.add_argument("--timeout", type=float, default=180, help="seconds per test (default: %(default)s)")
    args = ap.parse_args(argv)
    if not any(args.tests.glob("test_*.py")):
        print(f"torch_dcp_suite: no test_*.py in {args.tests}: see tests/third_party/torch_dcp/README.md")
        return 2
    sys.path.insert(0, str(ROOT / "src"))
    fs = run(args.tests, False, args.keyword, args.timeout)
    st = run(args.tests, True, args.keyword, args.timeout)
    res = compare(fs, st)
    report(res, st)
    if args.json:
        args.json.write_text(json.dumps({**res, "file_system": fs, "stores": st}, indent=1) + "\n")
    return 1 if res["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
