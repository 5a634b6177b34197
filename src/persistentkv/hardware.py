"""Which GPU a run measures on: config ``hardware.target``, the GPUs of this host, their results
folder names.

Cheap on purpose: the Snakefile asks these questions every time the workflow loads, so a GPU is
found through ``nvidia-smi`` (one subprocess with a timeout) and torch is never imported. Only
``hardware.target: auto`` probes while the workflow loads; a named target (``nvidia-h200``)
gives the same DAG on every host that reads it, a login node without a GPU included, and each
GPU job checks its GPU when it runs (persistentkv.job_resources).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from .errors import require

#: nvidia-smi answers in well under a second; a hung driver must not hang the workflow.
NVIDIA_SMI_TIMEOUT_S = 10.0
#: hardware.target's two words; anything else names a GPU by its slug.
TARGET_AUTO, TARGET_NONE = "auto", "none"


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi lists it: its index there, its UUID (``GPU-...``) and its name."""

    index: int
    uuid: str
    name: str


def slug(gpu_name: str) -> str:
    """Results folder name of a GPU: lower case, runs of non-alphanumerics -> '-'.

    >>> slug("NVIDIA H200")
    'nvidia-h200'
    >>> slug("NVIDIA GeForce RTX 3060 (12 GB)")
    'nvidia-geforce-rtx-3060-12-gb'
    """
    text = re.sub(r"[^a-z0-9]+", "-", str(gpu_name).lower()).strip("-")
    require(bool(text), f"GPU name {gpu_name!r} has no letters or digits to name a results folder")
    return text


def _query(fields: str) -> list[str]:
    """The lines of ``nvidia-smi --query-gpu=<fields>``, one per GPU; none without a usable GPU."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        done = subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return lines if done.returncode == 0 else []


def detect_gpu() -> str | None:
    """Name of the first GPU nvidia-smi lists ("NVIDIA H200"), or None without one."""
    lines = _query("name")
    return lines[0] if lines else None


def detect_arch() -> str | None:
    """Compute capability of the first GPU as an nvcc arch ("9.0" -> "sm_90"), or None."""
    lines = _query("compute_cap")
    if not lines or not re.fullmatch(r"\d+\.\d+", lines[0]):
        return None
    major, minor = lines[0].split(".")
    return f"sm_{major}{minor}"


def gpus() -> list[Gpu]:
    """Every GPU nvidia-smi lists, in its order (empty without nvidia-smi or a GPU)."""
    found = []
    for line in _query("index,uuid,name"):
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) == 3 and parts[0].isdigit():
            found.append(Gpu(int(parts[0]), parts[1], parts[2]))
    return found


def target(config: dict) -> str | None:
    """The results folder (GPU slug) this run measures into, or None when it measures nothing.

    ``hardware.target``: ``auto`` asks nvidia-smi now, on the host reading the workflow (the first
    GPU it lists, None without one); ``none`` measures nothing; a slug (the schema checks its
    form) is returned as it is, whatever this host has.
    """
    value = config["hardware"]["target"]
    if value == TARGET_NONE:
        return None
    if value == TARGET_AUTO:
        name = detect_gpu()
        return slug(name) if name else None
    return value


def kernel_archs(config: dict, hw: str | None) -> list[str]:
    """Architectures the kernels rule compiles for: with ``hardware.target: auto`` and a GPU found
    (``hw``), that GPU's; else ``hardware.kernel_archs`` (a named target probes nothing)."""
    if config["hardware"]["target"] == TARGET_AUTO and hw is not None:
        arch = detect_arch()
        if arch is not None:
            return [arch]
    return list(config["hardware"]["kernel_archs"])
