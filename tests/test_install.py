"""`pip install tenplex` into an environment that already has torch: the package's own requirements must
leave that torch alone (a GPU user's CUDA build) and the installed wheel must work without the source tree."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def test_pip_install_into_an_environment_with_torch_keeps_that_torch_and_works(tmp_path):
    # the wheel, built as a user's pip would build it from the source tree
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w"]
    subprocess.run([*build, str(wheels), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("tenplex-*.whl")

    # a new environment that has torch and the other dependencies (this one's packages, pip among them;
    # tenplex left out)
    site = Path(torch.__file__).parents[1]
    deps = tmp_path / "deps"
    deps.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith(("tenplex", "__editable__", "__pycache__")) and entry.suffix != ".pth":
            (deps / entry.name).symlink_to(entry)
    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    where = [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    purelib = Path(subprocess.run(where, check=True, capture_output=True, text=True).stdout.strip())
    (purelib / "dependencies.pth").write_text(f"{deps}\n")

    # --no-index: a requirement that wanted another torch (or anything not there) fails here
    install = [str(python), "-m", "pip", "install", "-q", "--no-index", f"{wheel}[torch,store]"]
    r = subprocess.run(install, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr

    check = "import tenplex, torch; print(torch.__version__, torch.__file__, tenplex.__file__)"
    out = subprocess.run([str(python), "-c", check], check=True, capture_output=True, text=True, cwd=tmp_path)
    version, torch_file, tenplex_file = out.stdout.split()
    assert version == torch.__version__ and Path(torch_file).parent.parent == deps  # the same torch, kept
    assert Path(tenplex_file).is_relative_to(purelib)  # installed, not the source tree

    # the console script and the package data (the chooser's calibration) came with the wheel
    r = subprocess.run(
        [str(env / "bin" / "tenplex"), "choose", "--model", "tiny", "--devices", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "dp" in r.stdout, r.stdout + r.stderr
