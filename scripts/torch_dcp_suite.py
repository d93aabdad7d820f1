"""PyTorch's own DCP tests, run twice: on DCP's file system, and on tenplex's stores.

    python scripts/torch_dcp_suite.py [--tests DIR] [--json OUT] [-k EXPR]

The tests (PyTorch's `test/distributed/checkpoint` files that run on CPU with gloo; tests/third_party/
torch_dcp/README.md says which and from where) run unchanged with pytest. The stores variant starts a real
store daemon and puts tests/torch_dcp_swap on the path of every process, whose `sitecustomize` swaps DCP's
file-system storage for `StoreWriter`/`StoreReader`. Prints the pass counts per variant and every test that
passes on the file system but not on the stores; exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests" / "third_party" / "torch_dcp"
SWAP = ROOT / "tests" / "torch_dcp_swap"


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


def run(tests: Path, stores: bool, keyword: str | None, timeout: float) -> dict[str, str]:
    """One variant in a pytest process of its own (PyTorch's rules, none of this project's)."""
    with tempfile.TemporaryDirectory(prefix="tenplex-dcp-suite-") as tmp:
        ini, report = Path(tmp, "pytest.ini"), Path(tmp, "report.xml")
        ini.write_text("[pytest]\n")
        env = {**os.environ, "TENPLEX_STATE_DIR": tmp, "TENPLEX_DCP_SWAP": "1" if stores else "0"}
        paths = [str(ROOT / "src"), *([str(SWAP)] if stores else []), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        cmd = [sys.executable, "-m", "pytest", str(tests), "-c", str(ini), "--rootdir", str(tests),
               "-p", "no:cacheprovider", "-q", f"--junitxml={report}"]  # fmt: skip
        if keyword:
            cmd += ["-k", keyword]
        if stores:
            from tenplex.store import start_store

            with start_store() as store:
                env["TENPLEX_STORE"] = store.url
                subprocess.run(cmd, env=env, cwd=tmp, timeout=timeout, stdout=subprocess.DEVNULL)
        else:
            subprocess.run(cmd, env=env, cwd=tmp, timeout=timeout, stdout=subprocess.DEVNULL)
        if not report.exists():
            raise SystemExit(f"torch_dcp_suite: pytest wrote no report for {tests} (no test files there?)")
        return outcomes(report)


def compare(fs: dict[str, str], st: dict[str, str]) -> dict:
    """The counts, and the tests the file system passes that the stores do not."""
    count = {v: {k: sum(o == k for o in res.values()) for k in ("passed", "failed", "skipped")}
             for v, res in (("file_system", fs), ("stores", st))}  # fmt: skip
    lost = sorted(t for t, o in fs.items() if o == "passed" and st.get(t) != "passed")
    return {"counts": count, "fs_passed": count["file_system"]["passed"], "lost": lost}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tests", type=Path, default=TESTS, help="folder of PyTorch's test files (default: %(default)s)"
    )
    ap.add_argument("--json", type=Path, help="also write the outcomes and counts here")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression: run only the matching tests")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per variant (default: %(default)s)")
    args = ap.parse_args(argv)
    if not any(args.tests.glob("test_*.py")):
        print(f"torch_dcp_suite: no test_*.py in {args.tests}: see tests/third_party/torch_dcp/README.md")
        return 2
    sys.path.insert(0, str(ROOT / "src"))
    fs = run(args.tests, False, args.keyword, args.timeout)
    st = run(args.tests, True, args.keyword, args.timeout)
    res = compare(fs, st)
    for variant, c in res["counts"].items():
        print(f"{variant:12} passed {c['passed']:3}  failed {c['failed']:3}  skipped {c['skipped']:3}")
    ok = res["fs_passed"] - len(res["lost"])
    print(f"stores pass {ok} of the {res['fs_passed']} tests the file system passes")
    for name in res["lost"]:
        print(f"  not on the stores: {name} ({st.get(name, 'not run')})")
    if args.json:
        args.json.write_text(json.dumps({**res, "file_system": fs, "stores": st}, indent=1) + "\n")
    return 1 if res["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
