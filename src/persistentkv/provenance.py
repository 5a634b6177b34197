"""Provenance of a GPU run: the sidecar JSON written beside every GPU output (docs/DATA.md).

``{run_id: {gpu, gpu_uuid, gpu_index, cpus, sm_count, l2_bytes, sm_clock_mhz, mem_clock_mhz, driver,
cuda, python, torch, cupy, flashinfer, vllm, cudnn_frontend, git_commit, git_dirty, config_hash, seeds,
started_at, command}}``

``gpu_index`` (nvidia-smi's) and ``cpus`` are what the workflow job was given
(persistentkv.job_resources); ``gpu_uuid`` is that GPU's, else the one torch reports. Anything that
cannot be determined is null (never guessed): a missing package's version, clocks without
nvidia-smi, the git commit of a tree copied without its .git.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib
import json
import os
import platform
import shlex
import subprocess
import sys
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

from .io import atomic_write_json

FIELDS = ("gpu", "gpu_uuid", "gpu_index", "cpus", "sm_count", "l2_bytes", "sm_clock_mhz", "mem_clock_mhz",
          "driver", "cuda", "python", "torch", "cupy", "flashinfer", "vllm", "cudnn_frontend", "git_commit", "git_dirty",
          "config_hash", "seeds", "started_at", "command")


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def new_run_id(label: str, started_at: str | None = None) -> str:
    """``published-20261129T213000Z-1a2b3c`` style: sortable by time, unique per run."""
    stamp = (started_at or utc_now()).replace("-", "").replace(":", "")
    return f"{label}-{stamp}-{uuid.uuid4().hex[:6]}"


def config_hash(config: dict) -> str:
    """sha256 of the config's canonical JSON (sorted keys): equal configs hash equal."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def package_version(name: str, module: str | None = None) -> str | None:
    """Installed version of ``name``; else ``module.__version__`` (the vLLM slice carried to the H200
    has no dist-info, its vllm/_version.py has the version); else None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
    for candidate in ([module] if module else []) + [name.replace("-", "_")]:
        try:
            mod = importlib.import_module(candidate)
        except Exception:
            continue
        version = getattr(mod, "__version__", None)
        if version:
            return str(version)
    return None


def _run(cmd: list[str], cwd: str | Path | None = None, timeout: float = 10.0) -> str | None:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(root: str | Path = ".") -> tuple[str | None, bool | None]:
    """(commit, dirty) of the working tree at ``root``.

    Whoever copied the tree to a GPU host may say what it copied in PERSISTENTKV_GIT_COMMIT and
    PERSISTENTKV_GIT_DIRTY (1/0); when set, they win over git, since a copied tree may carry a
    stale .git (one seen on the H200 host answered the session's first commit). Else git, else
    (None, None)."""
    env_commit = os.environ.get("PERSISTENTKV_GIT_COMMIT") or None
    if env_commit is not None:
        env_dirty = os.environ.get("PERSISTENTKV_GIT_DIRTY")
        return env_commit, (None if env_dirty is None else env_dirty.strip() not in ("", "0", "false"))
    commit = _run(["git", "rev-parse", "HEAD"], cwd=root)
    if commit is None:
        return None, None
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return commit, (None if status is None else bool(status))


def nvidia_smi(gpu: int | str = 0) -> dict[str, Any]:
    """Current SM and memory clocks (MHz) and the driver version of ``gpu`` (nvidia-smi's index, or
    a UUID), from nvidia-smi (None if absent)."""
    out = _run(["nvidia-smi", f"--id={gpu}", "--query-gpu=clocks.sm,clocks.mem,driver_version",
                "--format=csv,noheader,nounits"])
    result: dict[str, Any] = {"sm_clock_mhz": None, "mem_clock_mhz": None, "driver": None}
    if not out:
        return result
    parts = [p.strip() for p in out.splitlines()[0].split(",")]
    if len(parts) >= 3:
        for key, value in zip(("sm_clock_mhz", "mem_clock_mhz"), parts[:2]):
            try:
                result[key] = int(float(value))
            except ValueError:
                result[key] = None
        result["driver"] = parts[2] or None
    return result


def torch_uuid(device) -> str | None:
    """``GPU-<uuid>`` of a TorchDevice's GPU as torch reports it (None where this torch cannot)."""
    try:
        import torch

        uuid_ = torch.cuda.get_device_properties(device.device).uuid
    except Exception:
        return None
    return f"GPU-{uuid_}" if uuid_ else None


def collect(config: dict, seeds: list[int], started_at: str, device=None, argv: list[str] | None = None,
            root: str | Path = ".") -> dict[str, Any]:
    """Every provenance field (``device``: a persistentkv.measure.device.TorchDevice, or None)."""
    from .job_resources import held_resources

    record: dict[str, Any] = {k: None for k in FIELDS}
    held = held_resources()
    record["cpus"] = held.get("cpus", sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)
    if device is not None and getattr(device, "is_cuda", False):
        record.update(gpu=device.name, sm_count=device.sm_count, l2_bytes=device.l2_bytes)
        record.update(gpu_index=held.get("gpu_index"), gpu_uuid=held.get("gpu_uuid") or torch_uuid(device))
        # torch counts devices after CUDA_VISIBLE_DEVICES, nvidia-smi before it: ask by UUID where known
        record.update(nvidia_smi(record["gpu_uuid"] or device.device.index or 0))
    try:
        import torch

        record["torch"] = torch.__version__
        record["cuda"] = torch.version.cuda
    except Exception:
        pass
    record["python"] = platform.python_version()
    record["cupy"] = package_version("cupy-cuda13x", "cupy") or package_version("cupy-cuda12x", "cupy")
    record["flashinfer"] = package_version("flashinfer-python", "flashinfer")
    record["vllm"] = package_version("vllm", "vllm")
    record["cudnn_frontend"] = package_version("nvidia-cudnn-frontend", "cudnn")  # flashinfer-cudnn's
    record["git_commit"], record["git_dirty"] = git_state(root)
    record["config_hash"] = config_hash(config)
    record["seeds"] = sorted(int(s) for s in seeds)
    record["started_at"] = started_at
    record["command"] = shlex.join(argv if argv is not None else sys.argv)
    return record


def sidecar_path(out: str | Path) -> Path:
    """``results/x/raw/published.parquet`` -> ``results/x/raw/published.json``."""
    return Path(out).with_suffix(".json")


def write_sidecar(out: str | Path, run_id: str, record: dict) -> Path:
    path = sidecar_path(out)
    atomic_write_json(path, {run_id: record})
    return path
