"""The package as a user installs it: a wheel built from the checkout carries the top-level kernels/
as persistentkv/kernels/, and installed into a fresh venv outside the checkout it compiles its
kernels for sm_80 and sm_90 from that copy (persistentkv compile-kernels). kernels_dir's order:
$PERSISTENTKV_KERNELS, the installed package's kernels/, the checkout's.

The wheel test needs nvcc, pip and PyPI (the build's setuptools, and NumPy: the one dependency the
import and the compile command load), and prints what it installs and compiles to the log."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from persistentkv import launch
from persistentkv.errors import PKVError
from persistentkv.kernel_build import FP8_MODULES, MODULES, cubin_name, nvcc_path
from persistentkv.model import step_ops

ROOT = Path(__file__).resolve().parents[1]
KERNEL_SOURCES = sorted(p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".cu", ".cuh"))
ARCHS = ("sm_80", "sm_90")
#: what a copy of the checkout leaves out where git cannot list its files
NOT_SOURCE = (".git", ".venv", "build", "*.egg-info", "__pycache__", ".snakemake", ".pytest_cache", ".hypothesis")


def test_kernels_dir_takes_the_environment_first(tmp_path, monkeypatch):
    (tmp_path / launch.KERNEL_FILE).write_text("// stand-in\n")
    monkeypatch.setenv("PERSISTENTKV_KERNELS", str(tmp_path))
    assert launch.kernels_dir() == tmp_path
    monkeypatch.setenv("PERSISTENTKV_KERNELS", str(tmp_path / "elsewhere"))
    with pytest.raises(PKVError, match="PERSISTENTKV_KERNELS=.*elsewhere holds no pkv_decode.cu"):
        launch.kernels_dir()


def test_kernels_dir_in_a_checkout_is_the_top_level_kernels(monkeypatch):
    monkeypatch.delenv("PERSISTENTKV_KERNELS", raising=False)
    assert launch.kernels_dir() == ROOT / "kernels"


def test_kernels_dir_missing_everywhere_names_what_it_searched(tmp_path, monkeypatch):
    import importlib.resources

    monkeypatch.delenv("PERSISTENTKV_KERNELS", raising=False)
    monkeypatch.setattr(importlib.resources, "files", lambda package: tmp_path / "site-packages" / package)
    monkeypatch.setattr(launch, "__file__", str(tmp_path / "checkout" / "src" / "persistentkv" / "launch.py"))
    with pytest.raises(PKVError) as caught:
        launch.kernels_dir()
    message = str(caught.value)
    assert "\n" not in message
    assert str(tmp_path / "site-packages" / "persistentkv" / "kernels") in message
    assert str(tmp_path / "checkout" / "kernels") in message


def copy_checkout(dest: Path) -> Path:
    """The checkout's files as they are (git's tracked and untracked-not-ignored ones), so the
    build sees neither a stale build/ nor writes into the checkout."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, text=True)
    if listed.returncode != 0:
        return Path(shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*NOT_SOURCE)))
    for name in filter(None, listed.stdout.split("\0")):
        source = ROOT / name
        if source.is_file():   # a tracked file deleted in the working tree is left out
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def run(cmd: list, cwd: Path, env: dict, log: list[str]) -> str:
    """Run ``cmd`` in ``cwd``; its command line and output go to ``log``; fails the test on error."""
    start = time.monotonic()
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True)
    output = (proc.stdout + proc.stderr).strip()
    log.append(f"$ {' '.join(str(c) for c in cmd)}   [{time.monotonic() - start:.0f} s]\n{output}")
    assert proc.returncode == 0, "\n".join(log)
    return proc.stdout


def requirement(wheel: Path, name: str) -> str:
    """The wheel's own Requires-Dist line for ``name`` (e.g. 'numpy>=1.26')."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    return next(line.split(":", 1)[1].strip() for line in lines
                if line.startswith("Requires-Dist:") and line.split(":", 1)[1].strip().startswith(name))


@pytest.mark.slow
@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not on PATH: the installed package cannot compile its kernels")
def test_the_wheel_carries_the_kernels_and_compiles_them_installed(tmp_path, capsys):
    log: list[str] = []
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PERSISTENTKV_KERNELS")}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")

    # the wheel, built from a copy of the checkout
    source = copy_checkout(tmp_path / "source")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp_path / "dist", "."], source, env, log)
    (wheel,) = (tmp_path / "dist").glob("persistentkv-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        carried = sorted(n for n in archive.namelist() if n.startswith("persistentkv/kernels/"))
    log.append(f"{wheel.name}: {', '.join(carried)}")
    assert carried == [f"persistentkv/kernels/{name}" for name in KERNEL_SOURCES], "\n".join(log)

    # a fresh venv outside the checkout: the wheel and NumPy (the import and compile-kernels need no more)
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], tmp_path, env, log)
    python = venv / "bin" / "python"
    run([python, "-m", "pip", "install", requirement(wheel, "numpy")], tmp_path, env, log)
    run([python, "-m", "pip", "install", "--no-deps", wheel], tmp_path, env, log)

    # from a folder outside the checkout, with the checkout on no path: the installed package compiles
    work = tmp_path / "work"
    work.mkdir()
    where = json.loads(run([python, "-c", "import json, persistentkv, persistentkv.launch as l; "
                            "print(json.dumps([persistentkv.__file__, str(l.kernels_dir())]))"], work, env, log))
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work, env, log).strip())
    assert Path(where[0]).is_relative_to(site) and Path(where[1]) == site / "persistentkv" / "kernels", "\n".join(log)
    arch_args = [a for arch in ARCHS for a in ("--arch", arch)]
    run([venv / "bin" / "persistentkv", "compile-kernels", *arch_args, "--out", "report.json", "--cubin-dir", "cubins"],
        work, env, log)
    with capsys.disabled():
        print("\n" + "\n".join(log))

    report = json.loads((work / "report.json").read_text())
    assert report["status"] == "ok" and report["archs"] == list(ARCHS)
    assert {p.name for p in (work / "cubins").glob("*.cubin")} == \
        {cubin_name(d, h, w, a) for d, h, w in MODULES for a in ARCHS} | \
        {cubin_name(d, h, w, a, "float8_e4m3", c) for d, h, w, c in FP8_MODULES for a in ARCHS} | \
        {step_ops.cubin_name(a) for a in ARCHS}
