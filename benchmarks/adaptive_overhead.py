"""Where a step's host time goes: plan() and run() of pkv-workqueue and adaptive, piece by piece,
optionally beside a reference copy of the package from another commit, in one process.

    python benchmarks/adaptive_overhead.py [--policy results/nvidia-h200/policy.json] [--repeats 40]
        [--ref build/dev/ref]            # time persistentkv_ref (an exported commit) beside this tree
        [--pieces]                       # also time the torch calls a plan is made of
        [--profile]                      # and cProfile 300 plans of each backend (top functions)
    python benchmarks/adaptive_overhead.py --export-ref COMMIT build/dev/ref   # here, with git

The published run had adaptive ~4 % behind pkv-workqueue on bucketed_b1 step rows (plan once +
32 layers, eager) while both run the same route and their kernel rows are equal. This times, per
case and interleaved (a shuffled order per repeat), the pieces of one step of each backend:
  plan_host   host time of plan() (for adaptive: the decision plus the delegate's plan)
  runs_host   host time of the 32 run() calls (before the closing synchronisation)
  step        synchronised wall time of plan + 32 runs (the step protocol's number)
  layers      synchronised wall time of 32 runs with the plan made before (no plan in the window)
Medians in us, with the differences between backends per piece. Layers cycle over cold cache
copies as in the other benches. With --ref, backends ``ref:NAME`` are the reference package's,
and each case first checks that both packages' plans give bit-identical outputs. Writes
adaptive_overhead_HHMMSS.parquet to --out ($OUT).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402

from bench_common import write_rows  # noqa: E402
from graph_timing import rotated_copies  # noqa: E402

CASES = {"B=1 N=8200": [8200], "B=1 N=32768": [32768], "B=8 N=4096": [4096] * 8}
LAYERS = 32
REF_PACKAGE = "persistentkv_ref"


def export_ref(commit: str, dest: Path) -> Path:
    """src/persistentkv of ``commit`` as package persistentkv_ref under ``dest`` (its absolute
    self-references renamed), for --ref on a machine without git."""
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src/persistentkv"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    package = dest / REF_PACKAGE
    (dest / "src" / "persistentkv").rename(package)
    (dest / "src").rmdir()
    for path in package.rglob("*.py"):
        text = path.read_text()
        renamed = re.sub(r"\bpersistentkv\.(backends|commands|measure|render)\b", REF_PACKAGE + r".\1", text)
        if renamed != text:
            path.write_text(renamed)
    (dest / "COMMIT").write_text(subprocess.run(["git", "-C", str(ROOT), "rev-parse", commit], check=True,
                                                capture_output=True, text=True).stdout)
    return package


def one(backend, batch, q, copies, out, sync) -> dict:
    sync()
    t0 = time.perf_counter()
    plan = backend.plan(batch)
    t1 = time.perf_counter()
    for layer in range(LAYERS):
        backend.run(q, copies[layer % len(copies)], plan, out)
    t2 = time.perf_counter()
    sync()
    t3 = time.perf_counter()
    for layer in range(LAYERS):
        backend.run(q, copies[layer % len(copies)], plan, out)
    sync()
    t4 = time.perf_counter()
    return {"plan_host": (t1 - t0) * 1e6, "runs_host": (t2 - t1) * 1e6, "step": (t3 - t0) * 1e6,
            "layers": (t4 - t3) * 1e6}


def pieces(torch, batch, repeats: int) -> list[dict]:
    """Host time of the torch calls a GPU plan is made of (median of ``repeats``, us)."""
    packed = np.concatenate([batch.seq_lens, batch.kv_indptr, batch.kv_indices]).astype(np.int32)
    dev = torch.empty((packed.size + 4096,), dtype=torch.int32, device="cuda")
    staging = torch.empty((packed.size,), dtype=torch.int32, pin_memory=True)
    calls = {
        "pageable .to(device) (syncs)": lambda: torch.from_numpy(packed).to("cuda"),
        "torch.empty pinned + numpy fill": lambda: torch.empty((packed.size,), dtype=torch.int32,
                                                               pin_memory=True).numpy().__setitem__(slice(None), packed),
        "copy_ pinned non_blocking": lambda: dev[:packed.size].copy_(staging, non_blocking=True),
        "torch.empty device": lambda: torch.empty((4096,), dtype=torch.int32, device="cuda"),
        "torch.zeros device": lambda: torch.zeros((4096,), dtype=torch.int32, device="cuda"),
        "tensor slice": lambda: dev[8:100],
    }
    rows = []
    for name, call in calls.items():
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        rows.append({"piece": name, "host_us": float(np.median(times))})
    return rows


def profile_plans(backends: dict, batch, calls: int = 300, top: int = 18) -> None:
    """cProfile ``calls`` plans of each backend (a synchronisation between plans, outside the
    profile) and print the functions with the most own time."""
    import cProfile
    import io
    import pstats

    import torch

    for name, backend in backends.items():
        profiler = cProfile.Profile()
        for _ in range(calls):
            torch.cuda.synchronize()
            profiler.enable()
            backend.plan(batch)
            profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
        lines = [line for line in text.getvalue().splitlines() if line.strip()]
        print(f"  profile of {calls} plans, {name}:")
        print("\n".join("    " + line for line in lines[2:]))


def main() -> int:
    import pandas as pd

    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", default=str(ROOT / "results" / "nvidia-h200" / "policy.json"))
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--ref", default=None, help="folder holding persistentkv_ref (see --export-ref)")
    parser.add_argument("--pieces", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--export-ref", nargs=2, metavar=("COMMIT", "DEST"))
    args = parser.parse_args()
    if args.export_ref:
        print(export_ref(*args.export_ref))
        return 0
    import torch

    from persistentkv.backends import registry
    from persistentkv.cache import make_batch
    from persistentkv.spec import AttentionSpec

    t_start = time.time()
    os.environ.setdefault("PERSISTENTKV_KERNELS", str(ROOT / "kernels"))
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    backends = {"adaptive": registry.create("adaptive", policy_path=args.policy),
                "pkv-workqueue": registry.create("pkv-workqueue")}
    if args.ref:
        sys.path.insert(0, str(Path(args.ref).resolve()))
        ref_registry = importlib.import_module(f"{REF_PACKAGE}.backends.registry")
        ref_commit = (Path(args.ref) / "COMMIT").read_text().strip()[:7]
        print(f"reference: {REF_PACKAGE} of {ref_commit}")
        backends.update({"ref:adaptive": ref_registry.create("adaptive", policy_path=args.policy),
                         "ref:pkv-workqueue": ref_registry.create("pkv-workqueue")})
    rng = np.random.default_rng(0)
    rows, piece_rows = [], []
    for label, lengths in CASES.items():
        batch = make_batch(spec, lengths, seed=1)
        copies, q = rotated_copies(spec, batch, torch.cuda.get_device_properties(0).L2_cache_size)
        out = torch.empty_like(q)
        if args.ref:  # the two packages' plans are interchangeable: bit-identical outputs
            outputs = {}
            for name in ("pkv-workqueue", "ref:pkv-workqueue"):
                b = backends[name]
                b.run(q, copies[0], b.plan(batch), out)
                outputs[name] = out.clone()
            torch.cuda.synchronize()
            if not torch.equal(outputs["pkv-workqueue"], outputs["ref:pkv-workqueue"]):
                raise SystemExit(f"{label}: this tree's pkv-workqueue output differs from the reference's")
        for name, b in backends.items():  # warm-up: modules, memo, allocators
            for _ in range(3):
                one(b, batch, q, copies, out, torch.cuda.synchronize)
        for r in range(args.repeats):
            for name in rng.permutation(list(backends)):
                rows.append({"case": label, "backend": name, "repeat": r,
                             **one(backends[name], batch, q, copies, out, torch.cuda.synchronize)})
        route = backends["adaptive"].last_decision.backend
        med = pd.DataFrame([x for x in rows if x["case"] == label]).groupby("backend").median(numeric_only=True)
        med = med.drop(columns="repeat")
        print(f"{label} (adaptive routes to {route}):")
        print(med.round(1).to_string())
        pairs = [("adaptive", "pkv-workqueue")] + ([("pkv-workqueue", "ref:pkv-workqueue"),
                                                    ("adaptive", "ref:adaptive")] if args.ref else [])
        for a, b in pairs:
            diff = med.loc[a] - med.loc[b]
            print(f"  {a} - {b}: " + ", ".join(f"{k} {v:+.1f}" for k, v in diff.items()), flush=True)
        if args.profile:
            profile_plans(backends, batch)
        if args.pieces:
            for row in pieces(torch, batch, args.repeats * 5):
                piece_rows.append({"case": label, **row})
                print(f"  piece {row['piece']}: {row['host_us']:.1f} us")
        del copies
        torch.cuda.empty_cache()
    write_rows(rows, args.out, "adaptive_overhead", t_start)
    if piece_rows:
        write_rows(piece_rows, args.out, "plan_pieces", t_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
