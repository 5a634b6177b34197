"""persistentkv compile-kernels: compile kernels/ for named architectures (no GPU needed): the engine's
attention modules (persistentkv.kernel_build) and the decode step's own kernels (persistentkv.model.step_ops)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from ..errors import require
from ..io import atomic_write_json


def add_arguments(parser) -> None:
    parser.add_argument("--arch", action="append", default=[],
                        help="target architecture (repeatable), e.g. sm_80, sm_90; 'native' = the GPU present")
    parser.add_argument("--out", required=True, help="JSON report: resources per kernel, arch and config")
    parser.add_argument("--cubin-dir", default="build/kernels", help="where the cubins go")


def native_arch() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return f"sm_{out[0].replace('.', '')}" if out else None


def run(args) -> int:
    from ..kernel_build import compile_all, nvcc_path  # the engine's module (NumPy, CuPy probes): loaded to compile
    from ..model import step_ops

    archs = []
    for arch in args.arch or ["native"]:
        if arch == "native":
            found = native_arch()
            require(found is not None, "--arch native: no GPU found (nvidia-smi); name architectures instead")
            archs.append(found)
        else:
            archs.append(arch)
    if nvcc_path() is None:
        atomic_write_json(args.out, {"status": "skipped", "reason": "nvcc not found on PATH", "archs": archs, "kernels": []})
        print(f"compile-kernels: nvcc not found; wrote {args.out} saying so")
        return 0
    rows = compile_all(archs, Path(args.cubin_dir)) + step_ops.compile_report(archs, Path(args.cubin_dir))
    atomic_write_json(args.out, {"status": "ok", "archs": archs, "kernels": rows})
    worst = max(rows, key=lambda r: r.get("spill_store_bytes", 0))
    ctas = f" ctas={worst['ctas_per_sm']}" if worst.get("ctas_per_sm") else ""
    print(f"compile-kernels: {len(rows)} kernel instances for {', '.join(archs)}; "
          f"max registers {max(r['registers'] for r in rows)}, max spill stores {worst.get('spill_store_bytes', 0)} B "
          f"({worst['kernel']} {worst['dtype']}{' FP8' if worst.get('kv_dtype') == 'float8_e4m3' else ''} "
          f"D={worst['head_dim']} warps={worst['warps']}{ctas} {worst['arch']})")
    print(json.dumps({"report": args.out}))
    return 0
