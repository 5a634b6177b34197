"""Which machine is this: the GPU (if any), its results folder name, and whether to measure.

Cheap on purpose: the Snakefile asks these questions every time the workflow loads, so the GPU
is found through ``nvidia-smi`` (one subprocess with a timeout) and torch is never imported.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from .errors import PKVError, require

#: nvidia-smi answers in well under a second; a hung driver must not hang the workflow.
NVIDIA_SMI_TIMEOUT_S = 10.0
MEASURE_MODES = ("auto", "always", "never")


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


def _query(field: str) -> str | None:
    """First line of ``nvidia-smi --query-gpu=<field>``, or None when there is no usable GPU."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, f"--query-gpu={field}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        return None
    return lines[0]


def detect_gpu() -> str | None:
    """Name of the first GPU nvidia-smi lists ("NVIDIA H200"), or None without one."""
    return _query("name")


def detect_arch() -> str | None:
    """Compute capability of the first GPU as an nvcc arch ("9.0" -> "sm_90"), or None."""
    cap = _query("compute_cap")
    if cap is None or not re.fullmatch(r"\d+\.\d+", cap):
        return None
    major, minor = cap.split(".")
    return f"sm_{major}{minor}"


def measure_enabled(config: dict, gpu: str | None | bool = False) -> bool:
    """Whether the GPU rules run: config ``hardware.measure`` is auto, always or never.

    ``gpu`` is the detected GPU name (pass it when already known; by default it is detected).
    ``always`` without a GPU is an error, so a run that must measure never silently renders
    the committed reference instead.
    """
    mode = config["hardware"]["measure"]
    require(mode in MEASURE_MODES, f"hardware.measure={mode!r} is not one of {', '.join(MEASURE_MODES)}")
    if mode == "never":
        return False
    name = detect_gpu() if gpu is False else gpu
    if mode == "always" and name is None:
        raise PKVError("hardware.measure is 'always' but no GPU was found (nvidia-smi is missing or "
                       "lists none); use 'auto' to render the committed reference instead")
    return name is not None


def kernel_archs(config: dict, present_arch: str | None = None) -> list[str]:
    """Architectures the kernels rule compiles for: the present GPU's, else hardware.kernel_archs."""
    return [present_arch] if present_arch else list(config["hardware"]["kernel_archs"])

