"""Ahead-of-time compilation of kernels/ with nvcc, and ptxas' resource report per kernel.

The engine compiles the same source with the same options through CuPy at run time
(launch.compile_options); this module exists so that a machine without a GPU (CI, a laptop)
proves every kernel compiles for named architectures, and so that registers, shared memory,
stack and spills are recorded next to the results.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import lru_cache
from itertools import product
from pathlib import Path

from .errors import require
from .launch import (CTAS_MAX_HEAD_DIM, ENGINE_CTAS_PER_SM, ENGINE_WARPS, KERNEL_FILE, WARPS8_MAX_HEAD_DIM,
                     compile_options, kernels_dir)
from .spec import FP8_KV, AttentionSpec

#: Every module the engine can build, as (dtype, head_dim, warps): 8 warps at head_dim <= 128 only.
MODULES = tuple((d, h, w) for w in ENGINE_WARPS for d, h in product(("float16", "bfloat16"), (64, 128, 256))
                if w == 4 or h <= WARPS8_MAX_HEAD_DIM)
#: The modules over an FP8 e4m3 cache, as (dtype, head_dim, warps, ctas_per_sm): MODULES' shapes at
#: the default CTAs per SM (None), and the 4-warp modules built for 3 and 4 at head_dim <= 128.
FP8_MODULES = tuple((d, h, w, None) for d, h, w in MODULES) + tuple(
    (d, h, 4, c) for c in ENGINE_CTAS_PER_SM[4][1:] for d, h in product(("float16", "bfloat16"), (64, 128, 256))
    if h <= CTAS_MAX_HEAD_DIM)
#: At most this many bytes of spill stores (and loads) in a module built for 4 CTAs per SM (128
#: registers): at head_dim 128, nvcc 13.0, 8-20 on sm_90 and 28-46 on sm_80 (bf16 the most); at 64
#: none. Every other module spills nothing (tests/test_kernels_compile.py holds both).
CTAS4_MAX_SPILL_BYTES = 64
_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


def check_arch(arch: str) -> str:
    require(re.fullmatch(r"sm_\d{2,3}a?", arch) is not None, f"architecture {arch!r} is not of the form sm_XY")
    require(int(re.sub(r"\D", "", arch)) >= 80, f"architecture {arch} is older than sm_80 (cp.async and bf16 mma need sm_80+)")
    return arch


def parse_ptxas(text: str) -> list[dict]:
    """Per entry function: registers, static shared bytes, stack frame, spill stores/loads."""
    rows, current = [], None
    for line in text.splitlines():
        if (m := _ENTRY.search(line)):
            current = {"kernel": m.group(1), "arch": m.group(2)}
            rows.append(current)
        elif current is not None and (m := _FRAME.search(line)):
            current.update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)),
                           spill_load_bytes=int(m.group(3)))
        elif current is not None and (m := _USED.search(line)):
            current.update(registers=int(m.group(1)), static_shared_bytes=int(m.group(2) or 0))
    return rows


def cubin_name(dtype: str, head_dim: int, warps: int, arch: str, kv_dtype: str | None = None,
               ctas_per_sm: int | None = None) -> str:
    """The default module keeps its historical name; other warp counts add a ``_w{warps}`` suffix,
    an FP8 cache ``_fp8`` after the dtype, a module built for more CTAs per SM ``_c{ctas}``."""
    kv = "_fp8" if kv_dtype == FP8_KV else ""
    return (f"pkv_{dtype}{kv}_d{head_dim}_{arch}{'' if warps == 4 else f'_w{warps}'}"
            f"{f'_c{ctas_per_sm}' if ctas_per_sm else ''}.cubin")


@lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]


def compile_module(arch: str, source: Path, cubin: Path, options: list[str], what: str) -> list[dict]:
    """nvcc ``source`` to ``cubin`` for ``arch`` with ``options``; one row per kernel (ptxas'
    report, with nvcc's version, the flags and the cubin's name). ``what`` names the module in an
    error. The engine's modules (:func:`compile_all`) and the decode step's own kernels
    (persistentkv.model.step_ops.compile_report) go through it."""
    nvcc = nvcc_path()
    require(nvcc is not None, "nvcc not found on PATH")
    cubin.parent.mkdir(parents=True, exist_ok=True)
    cmd = [nvcc, "-cubin", f"-arch={check_arch(arch)}", "-O3", "-Xptxas", "-v", "-o", str(cubin), *options, str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed for {arch} {what}:\n{proc.stderr[-4000:]}")
    version = nvcc_version(nvcc)
    rows = parse_ptxas(proc.stderr)
    for row in rows:
        row.update(nvcc=version, flags=" ".join(options), cubin=cubin.name)
    return rows


def compile_all(archs: list[str], out_dir: Path) -> list[dict]:
    """Compile every module of MODULES (a cache of the query's dtype) and of FP8_MODULES for every
    arch to cubins under ``out_dir``; one row per kernel, with the module's ``dtype``, ``kv_dtype``
    (the cache's), ``head_dim``, ``warps`` and ``ctas_per_sm`` (None: the warps' default)."""
    modules = [(d, h, w, None, None) for d, h, w in MODULES] + [(d, h, w, FP8_KV, c) for d, h, w, c in FP8_MODULES]
    rows = []
    for arch, (dtype, head_dim, warps, kv, ctas) in product([check_arch(a) for a in archs], modules):
        spec = AttentionSpec(1, 1, head_dim, 16, dtype, kv_dtype=kv)
        options = list(compile_options(spec, warps, ctas_per_sm=ctas))
        what = f"{dtype}{' FP8' if kv else ''} D={head_dim} warps={warps}{f' ctas={ctas}' if ctas else ''}"
        for row in compile_module(arch, kernels_dir() / KERNEL_FILE,
                                  out_dir / cubin_name(dtype, head_dim, warps, arch, kv, ctas), options, what):
            rows.append({**row, "dtype": dtype, "kv_dtype": kv or dtype, "head_dim": head_dim, "warps": warps,
                         "ctas_per_sm": ctas})
    return rows
