"""README.md's main job on a fresh clone rewrites every tracked output byte for byte.

The clone is of this checkout's HEAD, in a temporary folder; `snakemake --cores 2 all` runs there
with this interpreter's environment (set up from constraints.txt) and the clone's own source, and
`git status --porcelain` must then be empty: no claims.json, report, counters table or paper
figure differs from what is committed (the published precision, persistentkv.io.PRECISION,
absorbs the machine's summation order; constraints.txt fixes the libraries). About 4 minutes on
2 CPU cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from workflow_support import failure

REPO = Path(__file__).resolve().parents[1]
#: Far above the ~4 minutes `all` takes on 2 cores without a GPU.
TIMEOUT_S = 40 * 60


def run(argv, cwd, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_all_on_a_fresh_clone_leaves_git_status_clean(tmp_path):
    bin_dir = Path(sys.executable).parent
    snakemake = shutil.which("snakemake", path=str(bin_dir)) or shutil.which("snakemake")
    if snakemake is None:
        pytest.skip("snakemake is not installed (pip install -c constraints.txt -e '.[workflow,test]')")
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout to clone")
    if shutil.which("nvidia-smi") is not None:
        pytest.skip("on a GPU host `all` measures that GPU, which is not what this test checks")
    head = run(["git", "rev-parse", "HEAD"], REPO).stdout.strip()
    clone = tmp_path / "clone"
    cloned = run(["git", "clone", "-q", "--no-checkout", str(REPO), str(clone)], tmp_path)
    assert cloned.returncode == 0, cloned.stderr
    checkout = run(["git", "checkout", "-q", "--detach", head], clone)
    assert checkout.returncode == 0, checkout.stderr

    # The clone's package, not the one this environment installed in editable mode from REPO.
    env = {**os.environ, "PYTHONPATH": str(clone / "src"), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    start = time.monotonic()
    done = run([snakemake, "--cores", "2", "all"], clone, env=env, timeout=TIMEOUT_S)
    wall = time.monotonic() - start
    assert done.returncode == 0, f"snakemake all failed after {wall:.0f} s:\n{failure(done, clone)}"
    status = run(["git", "status", "--porcelain"], clone).stdout
    assert status == "", f"`all` changed tracked files ({wall:.0f} s):\n{status}"
    print(f"snakemake --cores 2 all on a fresh clone: {wall:.0f} s")
