"""Helpers of the workflow tests: a copy of the repository's workflow, a small grid, Snakemake run
as a user runs it, and stand-ins for nvidia-smi and for the GPU commands."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
#: What the workflow reads from the repository (results/ and paper/ are outputs or optional inputs).
WORKFLOW_PARTS = ("workflow", "config", "kernels", "environment.yml")

needs_snakemake = pytest.mark.skipif(importlib.util.find_spec("snakemake") is None,
                                     reason="the workflow needs snakemake (Python >= 3.11)")

NO_GPU = "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver' >&2\nexit 9\n"


def copy_workflow(dest: Path) -> Path:
    """The workflow's parts of the repository under ``dest`` (the fresh clone a user starts from)."""
    dest.mkdir(parents=True, exist_ok=True)
    for part in WORKFLOW_PARTS:
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.is_file():
            shutil.copy2(source, dest / part)
    return dest


#: The small grid's trace: short rows, so that the CPU validation and the counters take seconds.
TINY_TRACE = "request_id,arrival_step,prompt_len,decode_steps\n0,0,300,6\n1,0,900,4\n2,1,150,6\n3,2,2100,3\n"


#: measure.e2e_passes of the small grid: more than one, fewer than the repository's.
SMALL_E2E_PASSES = 2


def small_config(repo: Path, **hardware) -> dict:
    """Rewrite ``repo``'s config/config.yaml as a small grid (one short file trace and one
    generated trace of few steps, one holdout seed, three split values) with ``hardware``
    entries replaced; returns it. Every rule keeps its jobs, fewer and shorter ones."""
    path = repo / "config" / "config.yaml"
    (repo / "config" / "tiny_trace.csv").write_text(TINY_TRACE)
    config = yaml.safe_load(path.read_text())
    config["seeds"]["holdout"] = config["seeds"]["holdout"][:1]
    config["traces"] = [{"name": "tiny", "kind": "file", "path": "config/tiny_trace.csv", "max_active": 4,
                         "num_steps": 8, "splits": 8},
                        {"name": "uniform_b2", "kind": "uniform", "num_requests": 4, "max_active": 2,
                         "num_steps": 4, "splits": 8}]
    names = [t["name"] for t in config["traces"]]
    config["ablations"]["buckets"]["traces"] = names
    config["ablations"]["splits"] = {"traces": names, "values": [1, 8, 32]}
    config["validation"]["cpu"]["steps_per_trace"] = 1
    config["measure"]["gqa_sweep"]["trace"] = names[0]
    config["measure"]["fragmented"]["traces"] = names[:1]
    config["measure"]["e2e_passes"] = SMALL_E2E_PASSES
    config["hardware"].update(hardware)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return config


def fake_nvidia_smi(bin_dir: Path, gpus: list[str] | None, calls: Path | None = None) -> None:
    """An nvidia-smi on ``bin_dir`` that lists ``gpus`` (names; None: a host without a working GPU)
    as index, UUID GPU-fake-<i>, name; with ``calls``, each invocation appends a line there."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = f'echo "$*" >> "{calls}"\n' if calls else ""
    if gpus is None:
        body = NO_GPU.replace("#!/bin/sh\n", "")
    else:
        listing = "\\n".join(f"{i}, GPU-fake-{i}, {name}" for i, name in enumerate(gpus))
        body = ('case "$*" in\n'
                f'  *index,uuid,name*) printf "{listing}\\n" ;;\n'
                '  *compute_cap*) echo 9.0 ;;\n'
                f'  *name*) echo "{gpus[0] if gpus else ""}" ;;\n'
                '  *) echo unknown ;;\nesac\n')
    exe = bin_dir / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + log + body)
    exe.chmod(0o755)


#: A stand-in `persistentkv` for the GPU commands (and the compile, which needs nvcc): it sleeps
#: $PKV_FAKE_SLEEP s, writing its --out half-way and the provenance sidecar at the end (a job
#: stopped in between leaves one of its two outputs), fails where its command line contains
#: $PKV_FAKE_FAIL (before writing) or $PKV_FAKE_STOP (after writing both), and records what it
#: holds, its CPUs and times in $PKV_FAKE_CALLS. Other commands run for real.
FAKE_PERSISTENTKV = r'''#!{python}
import json, os, sys, time
from pathlib import Path

FAKED = ("measure", "bench-kernels", "validate-gpu", "calibrate", "compile-kernels", "measure-e2e")
argv = sys.argv[1:]
if not argv or argv[0] not in FAKED:
    os.execv(sys.executable, [sys.executable, "-m", "persistentkv", *argv])
start = time.time()
half = float(os.environ.get("PKV_FAKE_SLEEP", "0")) / 2
out = Path(argv[argv.index("--out") + 1])
time.sleep(half)
fail = os.environ.get("PKV_FAKE_FAIL")
if fail and fail in " ".join(argv):
    print(f"error: {{fail}} failed on purpose", file=sys.stderr)
    sys.exit(2)
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text("fake\n")
time.sleep(half)
if argv[0] in ("measure", "bench-kernels", "validate-gpu", "measure-e2e"):
    out.with_suffix(".json").write_text(json.dumps({{f"fake-{{os.getpid()}}": {{"gpu": "fake"}}}}))
stop = os.environ.get("PKV_FAKE_STOP")
if stop and stop in " ".join(argv):  # stopped after writing (measure-e2e's partial rows)
    print(f"error: {{stop}} stopped on purpose after writing", file=sys.stderr)
    sys.exit(3)
record = {{"command": argv[0], "out": str(out), "start": start, "end": time.time(),
          "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
          "held": json.loads(os.environ.get("PERSISTENTKV_JOB_RESOURCES") or "{{}}"),
          "cpus": sorted(os.sched_getaffinity(0)), "slurm_job_id": os.environ.get("SLURM_JOB_ID")}}
with open(os.environ["PKV_FAKE_CALLS"], "a") as calls:
    calls.write(json.dumps(record) + "\n")
'''


def env_with_bin(bin_dir: Path) -> dict:
    """This process's environment with PATH leading to ``bin_dir`` (stand-ins), then to the interpreter
    running the tests (its `python` and `persistentkv` run the jobs), whichever environment is active."""
    return {**os.environ, "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent),
                                                   os.environ.get("PATH", "")])}


def gpu_env(bin_dir: Path, gpus: list[str] | None) -> dict:
    """env_with_bin(``bin_dir``) with fake_nvidia_smi's stand-in there listing ``gpus`` (None: a host
    without a working GPU)."""
    fake_nvidia_smi(bin_dir, gpus)
    return env_with_bin(bin_dir)


def fake_gpu_env(tmp_path: Path, gpus: list[str] | None, **extra) -> dict:
    """The environment of a run whose PATH starts with fake nvidia-smi and persistentkv commands."""
    bin_dir = tmp_path / "bin"
    fake_nvidia_smi(bin_dir, gpus)
    exe = bin_dir / "persistentkv"
    exe.write_text(FAKE_PERSISTENTKV.format(python=sys.executable))
    exe.chmod(0o755)
    env = env_with_bin(bin_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT / "src"), env.get("PYTHONPATH")] if p)
    env["PKV_FAKE_CALLS"] = str(tmp_path / "calls.jsonl")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def fake_calls(tmp_path: Path) -> list[dict]:
    path = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def snakemake(repo: Path, *args, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=timeout)


def failure(done: subprocess.CompletedProcess, repo: Path, tail: int = 4000) -> str:
    """What an assertion on a failed Snakemake run shows: the end of its stderr, then the end of
    the log of every job that failed (Snakemake names them "log: <path> (check log file(s) for
    error details)"), which a job run through SLURM or a subprocess leaves nowhere else."""
    parts = [done.stderr[-tail:]]
    for log in sorted(set(re.findall(r"log: (\S+) \(check log file", done.stderr))):
        path = repo / log
        text = path.read_text(errors="replace")[-tail // 2:] if path.is_file() else "(no such file)"
        parts.append(f"--- the end of {log}:\n{text}")
    return "\n".join(parts)


def job_counts(output: str) -> dict[str, int]:
    """Snakemake's 'Job stats' table as {rule: count} ({} when it has none: nothing to do)."""
    if "Job stats:" not in output:
        return {}
    table = output.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.MULTILINE)}
