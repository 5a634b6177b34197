"""Synthetic results in the formats of docs/DATA.md, for the tests of the renderers, claims and targets.

Nothing here is a measurement: every run_id starts with ``synthetic-`` and the provenance names
the GPU ``SYNTHETIC (test data)``, so a rendered page says so wherever it names its hardware.
Times follow a toy bandwidth model with lognormal noise; counters come from the real planner
(:mod:`persistentkv.plan`) on the real published traces, so their shapes are realistic.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pandas as pd

from persistentkv import io, plan, traces
from persistentkv.cache import make_batch
from persistentkv.reference import TOLERANCE
from persistentkv.spec import AttentionSpec

GPU = "SYNTHETIC (test data)"
RUN_ID = "synthetic-run"
HOLDOUT = (20260623, 20260624, 20260625)
CALIBRATION = 20260622
TRACES = {  # name -> (kind, num_requests, max_active, num_steps, splits)
    "bucketed_b1": ("bucketed", 16, 1, 64, 32),
    "bimodal_b8": ("bimodal", 24, 8, 48, 20),
    "uniform_b8": ("uniform", 24, 8, 48, 24),
    "zipf_b8": ("zipf", 24, 8, 48, 28),
    "bimodal_b4": ("bimodal", 16, 4, 48, 20),
    "homogeneous_b8": ("homogeneous", 24, 8, 48, 20),
}
BACKENDS = ("pkv-workqueue", "pkv-buckets", "pkv-split", "adaptive", "flashinfer-cc", "flashinfer-tc",
            "vllm-fa3", "trtllm-xqa", "torch-sdpa")
UNAVAILABLE = {"torch-sdpa": "synthetic: torch-sdpa skipped to keep the test data small"}
CEILING_GBPS = 4520.0
CEILING_FIXED_US = 12.0  #: the read kernel's own launch, ramp-up and tail (ceiling.stream_fit)
#: the run's ceiling: the read kernel's rate over 16 GiB, its fixed part included (ceiling.ceiling_gbps)
RUN_CEILING_GBPS = (16 << 30) / (CEILING_FIXED_US + (16 << 30) / (CEILING_GBPS * 1e3)) / 1e3
SPEC = AttentionSpec(32, 8, 128, 16, "float16")


def config(holdout=HOLDOUT) -> dict:
    """A config dict shaped like config/config.yaml (the keys the renderers read)."""
    return {"seeds": {"calibration": CALIBRATION, "holdout": list(holdout)},
            "hardware": {"reference": "nvidia-h200"},
            "measure": {"layers": 32, "repeats": 3, "gqa_sweep": {"trace": "bimodal_b8", "group_sizes": [1, 4, 8]}},
            "traces": [{"name": n, "kind": k, "num_requests": r, "max_active": a, "num_steps": s, "splits": sp}
                       for n, (k, r, a, s, sp) in TRACES.items()],
            "models": e2e_models()}


def _efficiency(backend: str, batch: int, max_len: int, ragged: float, hole: float) -> float:
    """Fraction of the read ceiling a backend reaches in the toy model."""
    fill = min(1.0, batch * 8 * max(1.0, max_len / 8192) / 132)      # CTAs per SM, roughly
    base = {"flashinfer-tc": 0.80 * fill ** 0.5, "flashinfer-cc": 0.62 * fill ** 0.5,
            "vllm-fa3": 0.78 * fill ** 0.5, "trtllm-xqa": 0.70 * fill ** 0.3,
            "pkv-workqueue": 0.78, "pkv-split": 0.74 - 0.2 * ragged, "pkv-buckets": 0.76 - 0.3 * ragged,
            "torch-sdpa": 0.15}[backend]
    if backend.startswith("pkv"):
        base *= 1 - 0.5 * hole                                      # scattered pages hurt our gathers
    return max(base, 0.05)


def _kernel_us(backend: str, lengths, hole: float, spec: AttentionSpec = SPEC) -> float:
    lengths = np.asarray(lengths)
    kv = float(lengths.sum()) * spec.kv_bytes_per_token
    ragged = float(lengths.std() / lengths.mean()) if lengths.size > 1 else 0.0
    eff = _efficiency(backend, lengths.size, int(lengths.max()), min(ragged, 1.0), hole)
    launches = {"pkv-buckets": 2 * len(set(lengths.tolist())), "pkv-split": 2, "pkv-workqueue": 1}.get(backend, 1)
    return kv / (CEILING_GBPS * 1e3 * eff) + 3.0 * launches


def _route(lengths) -> str:
    lengths = np.asarray(lengths)
    if lengths.size == 1 and lengths.max() >= 16384:
        return "pkv-buckets"
    if lengths.size >= 8 and lengths.max() >= 16384:
        return "pkv-workqueue"
    return "flashinfer-tc"


def _rows_for(experiment: str, trace: str, seed: int, steps, rng, protocols, repeats: int,
              hole: float = 0.0, spec: AttentionSpec = SPEC, backends=BACKENDS) -> list[dict]:
    rows = []
    for step, lengths in steps:
        lengths = np.asarray(lengths)
        kv = int(lengths.sum()) * spec.kv_bytes_per_token
        base = {b: _kernel_us(b, lengths, hole, spec) for b in backends if b not in ("adaptive",) + tuple(UNAVAILABLE)}
        route = _route(lengths)
        if "adaptive" in backends:
            base["adaptive"] = base[route]
        for protocol in protocols:
            for rep in range(repeats):
                for backend in backends:
                    if backend in UNAVAILABLE:
                        continue
                    k = base[backend]
                    plan_us = 40.0 if backend.startswith(("flashinfer", "adaptive")) else 12.0
                    layers = 32 if protocol == "step" else 1
                    if protocol == "kernel":
                        t = k
                    elif protocol == "eager":
                        t = k + 22.0
                    elif protocol == "published":     # FlashInfer's plan inside the window, ours outside
                        t = k + (plan_us if backend.startswith("flashinfer") else 0.0)
                    else:
                        t = plan_us + layers * (k + 6.0)
                    t *= float(np.exp(rng.normal(0, 0.03)))
                    rows.append({
                        "run_id": RUN_ID, "experiment": experiment, "trace": trace, "seed": seed, "step": int(step),
                        "batch_size": int(lengths.size), "max_len": int(lengths.max()),
                        "total_tokens": int(lengths.sum()), "kv_bytes": kv,
                        "num_qo_heads": spec.num_qo_heads, "num_kv_heads": spec.num_kv_heads,
                        "head_dim": spec.head_dim, "page_size": spec.page_size, "dtype": spec.dtype,
                        "hole_fraction": hole, "backend": backend,
                        "route": route if backend == "adaptive" else backend,
                        "num_splits": 20 if backend.startswith("pkv") else -1, "protocol": protocol,
                        "repeat": rep, "time_us": t,
                        "wall_us": t * 1.04 + 8.0 if protocol == "published" else np.nan,
                        "host_us": 22.0 if protocol == "eager" else np.nan,
                        "host_loop_us": (plan_us / 2 + 2.0) if protocol == "eager" else np.nan,
                        "host_loop_max_us": (plan_us + 6.0) if protocol == "eager" else np.nan, "layers": layers,
                        "per_layer_us": t / layers, "read_ceiling_gbps": CEILING_GBPS,
                        "frac_of_ceiling": kv / (t / layers) / 1e3 / CEILING_GBPS,
                        "launches": np.nan, "decode_ctas": np.nan, "merge_state_bytes": np.nan,
                        "status": "ok", "reason": ""})
    for backend, reason in UNAVAILABLE.items():
        if backend in backends:
            rows.append({"run_id": RUN_ID, "experiment": experiment, "trace": trace, "seed": seed, "step": -1,
                         "backend": backend, "route": backend, "protocol": protocols[0], "repeat": 0,
                         "time_us": np.nan, "wall_us": np.nan, "status": "unavailable", "reason": reason})
    return rows


def _trace_steps(name: str, seed: int, stride: int = 8):
    kind, n, active, steps, _ = TRACES[name]
    trace = traces.generate(kind, seed, n, active, steps, name=name)
    return [(s.index, s.lengths) for s in trace.steps[::stride]]


def _pinned(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of a run whose timing thread was pinned (measure.host_cpu): two CPUs by round, the
    probe 150 us + the repeat. The other synthetic experiments lack the columns, as runs from before
    the column do."""
    return frame.assign(host_cpu=3 + frame["repeat"] % 2, host_probe_us=150.0 + frame["repeat"])


def raw_frames(seeds=HOLDOUT, repeats: int = 3, seed: int = 0) -> dict[str, pd.DataFrame]:
    """experiment -> tidy timing rows (DATA.md, results/{hw}/raw/{experiment}.parquet)."""
    rng = np.random.default_rng(seed)
    out = {}
    rows = []
    for trace in ("bucketed_b1", "bimodal_b8", "uniform_b8", "zipf_b8", "bimodal_b4"):
        for s in seeds:
            rows += _rows_for("published", trace, s, _trace_steps(trace, s), rng, ("published", "step", "kernel"),
                              repeats)
    out["published"] = _pinned(pd.DataFrame(rows))
    rows = []
    for trace in ("bimodal_b8", "homogeneous_b8"):
        for s in seeds:
            rows += _rows_for("fragmented", trace, s, _trace_steps(trace, s), rng, ("published", "step"), repeats,
                              hole=0.5)
    out["fragmented"] = pd.DataFrame(rows)
    rows = []
    for g in (1, 4, 8):
        spec = AttentionSpec(8 * g, 8, 128, 16, "float16")
        for s in seeds:
            rows += _rows_for("gqa_sweep", "bimodal_b8", s, _trace_steps("bimodal_b8", s), rng,
                              ("published", "step"), repeats, spec=spec)
    out["gqa_sweep"] = pd.DataFrame(rows)
    rows = []
    for b in (1, 4, 16, 64):
        for n in (4096, 32768):
            rows += _rows_for("batch_sweep", f"B{b}xN{n}", 0, [(0, [n] * b)], rng, ("kernel", "step"), repeats)
    out["batch_sweep"] = pd.DataFrame(rows)
    rows = []
    for s in seeds:
        rows += _rows_for("split_sensitivity", "bimodal_b8", s, _trace_steps("bimodal_b8", s), rng, ("step",),
                          repeats, backends=("pkv-split", "flashinfer-tc"))
    frame = pd.DataFrame(rows)
    pkv = frame[frame["backend"] == "pkv-split"]
    # Toy sensitivity: best near S = 16, a few per cent per doubling away from it.
    parts = [frame[frame["backend"] != "pkv-split"]]
    for S in (4, 8, 16, 32, 64):
        scaled = pkv.assign(num_splits=S, time_us=pkv["time_us"] * (1 + 0.04 * abs(np.log2(S / 16))))
        parts.append(scaled.assign(per_layer_us=scaled["time_us"] / scaled["layers"]))
    out["split_sensitivity"] = pd.concat(parts, ignore_index=True)
    return out


def bench_frame(repeats: int = 3, seed: int = 1) -> pd.DataFrame:
    """bench_kernels.parquet: B=1 and batched kernel rows, plus read/copy ceiling rows."""
    rng = np.random.default_rng(seed)
    rows = []
    for b, n in [(1, 8192), (1, 32768), (1, 65536), (1, 131072), (4, 8192), (16, 4096), (64, 8192)]:
        rows += _rows_for("bench_kernels", f"B{b}xN{n}", 0, [(0, [n] * b)], rng, ("kernel", "eager"), repeats)
    frame = _pinned(pd.DataFrame(rows))
    # the read kernel at 4 and 16 GiB with a fixed cost of CEILING_FIXED_US: the run's ceiling is the
    # 16 GiB rate (RUN_CEILING_GBPS), which the 4 GiB samples stay below
    sizes = (("read-ceiling", CEILING_GBPS, 4 << 30, CEILING_FIXED_US), ("read-ceiling", CEILING_GBPS, 16 << 30, CEILING_FIXED_US),
             ("copy-ceiling", 3900.0, 8 << 30, 0.0))
    ceil = [{"run_id": RUN_ID, "experiment": "bench_kernels", "trace": name, "seed": 0, "step": 0,
             "backend": name, "route": name, "protocol": "ceiling", "repeat": i * repeats + r, "kv_bytes": nbytes,
             "time_us": fixed + nbytes / (gbps * 1e3), "per_layer_us": fixed + nbytes / (gbps * 1e3), "layers": 1,
             "read_ceiling_gbps": RUN_CEILING_GBPS, "status": "ok", "reason": ""}
            for i, (name, gbps, nbytes, fixed) in enumerate(sizes) for r in range(repeats)]
    return pd.concat([frame, pd.DataFrame(ceil)], ignore_index=True)


#: The GPU validation's tolerance per cache dtype (reference.TOLERANCE, the config's default) and
#: the decade of the toy worst (row, head) errors there: bfloat16 keeps three fewer mantissa bits.
VALIDATION_DTYPES = {"float16": (TOLERANCE["float16"], (-4.2, -3.3)), "bfloat16": (TOLERANCE["bfloat16"], (-3.3, -2.4))}
#: The toy whole-batch error (rel_err) as a fraction of the worst (row, head) error.
WHOLE_BATCH_FRACTION = 0.3


def validation_frame(seed: int = 2) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for trace in ("bimodal_b8", "bucketed_b1"):
        for step in (0, 7, 15, 31):
            for dtype, (rtol, decades) in VALIDATION_DTYPES.items():
                for backend in BACKENDS:
                    base = {"trace": trace, "seed": HOLDOUT[0], "step": step, "backend": backend, "dtype": dtype,
                            "rtol": rtol, "nan_count": 0, "unwritten": 0}
                    if backend in UNAVAILABLE:
                        rows.append({**base, "rel_err": np.nan, "max_row_head_err": np.nan, "worst_row": -1,
                                     "worst_head": -1, "row_heads_failing": 0, "max_abs_err": np.nan, "passed": False,
                                     "status": "unavailable", "reason": UNAVAILABLE[backend]})
                        continue
                    err = float(10 ** rng.uniform(*decades))
                    rows.append({**base, "rel_err": err * WHOLE_BATCH_FRACTION, "max_row_head_err": err,
                                 "worst_row": step % 8, "worst_head": (step * 5) % 32,
                                 "row_heads_failing": int(err > rtol), "max_abs_err": err * 3, "passed": err <= rtol,
                                 "status": "ok", "reason": ""})
    return pd.DataFrame(rows)


def ablation_frames(seed: int = CALIBRATION, stride: int = 6) -> dict[str, pd.DataFrame]:
    """ablation_buckets / ablation_splits / validation_cpu from the real planner on real traces."""
    buckets, splits, vcpu = [], [], []
    for name in ("bucketed_b1", "bimodal_b8", "uniform_b8", "zipf_b8", "bimodal_b4"):
        for step, lengths in _trace_steps(name, seed, stride):
            batch = make_batch(SPEC, np.asarray(lengths))
            variants = {"exact": plan.plan_buckets(batch, 32), "workqueue": plan.plan_workqueue(batch, 264),
                        "split_rect": plan.plan_split(batch, 32)}
            for t in (8192, 32768):
                variants[f"padded_{t}"] = plan.plan_buckets(batch, 32, bucket_tokens=t)
            for variant, p in variants.items():
                c = p.counters()
                buckets.append({"trace": name, "step": step, "variant": variant, "launches": c.launches,
                                "padded_kv_bytes": c.padded_kv_bytes, "merge_state_bytes": c.merge_state_bytes,
                                "paper_merge_state_bytes": c.paper_merge_state_bytes})
            for s in (1, 4, 16, 32, 64):
                for route, p in (("split", plan.plan_split(batch, s)), ("workqueue_fixed", plan.plan_workqueue(batch, num_splits=s))):
                    splits.append({"trace": name, "step": step, "route": route, "num_splits": s, **p.counters().to_dict()})
            vcpu.append({"trace": name, "seed": seed, "step": step, "route": "workqueue", "rel_err": 3e-4,
                         "max_row_head_err": 1e-3, "worst_row": 0, "worst_head": 0, "row_heads_failing": 0,
                         "max_abs_err": 1e-3, "rtol": TOLERANCE["float16"], "passed": True, "nan_count": 0,
                         "reason": ""})
    return {"ablation_buckets": pd.DataFrame(buckets), "ablation_splits": pd.DataFrame(splits),
            "validation_cpu": pd.DataFrame(vcpu)}


def provenance() -> dict:
    return {RUN_ID: {"gpu": GPU, "sm_count": 132, "l2_bytes": 62914560, "sm_clock_mhz": 1980, "mem_clock_mhz": 3201,
                     "driver": "synthetic", "cuda": "synthetic", "python": "3.11", "torch": "synthetic",
                     "cupy": "synthetic", "flashinfer": "synthetic", "vllm": "synthetic",
                     "git_commit": "0000000000000000000000000000000000000000", "git_dirty": False,
                     # as long as a real one (sha256 of the config), so the report's tables are laid out with it
                     "config_hash": hashlib.sha256(b"synthetic").hexdigest(), "seeds": list(HOLDOUT),
                     "started_at": "2026-01-01T00:00:00Z",
                     "command": "tests/synthetic.py"}}


def policy() -> dict:
    return {"calibration_seed": CALIBRATION, "fitted_at": "2026-01-01T00:00:00Z", "run_id": RUN_ID,
            "thresholds": {"b1": 16384, "b8": 16384}, "cost_model": {}, "candidates": list(BACKENDS[:6])}


def fp8_bench_frame(fp16: pd.DataFrame) -> pd.DataFrame:
    """bench_kernels_fp8.parquet from ``fp16`` (with_floor(bench_frame()) with kv_dtype float16): its
    kernel cases over an FP8 e4m3 cache, half the K/V bytes; ours at 0.56 of its fp16 time, the
    baselines at 0.7, the toy floor at the FP8 bytes."""
    from persistentkv.names import FLOOR_BACKEND, FP8_KV

    rows = fp16[(fp16["protocol"] != "ceiling")].copy()
    rows = rows.assign(kv_dtype=FP8_KV, kv_bytes=rows["kv_bytes"] // 2)
    scale = np.where(rows["backend"] == "pkv-workqueue", 0.56, 0.7)
    floor = (rows["backend"] == FLOOR_BACKEND).to_numpy()
    us = np.where(floor, FLOOR_FIXED_US + rows["kv_bytes"].astype(float) / (CEILING_GBPS * 1e3),
                  rows["time_us"].to_numpy(float) * scale)
    return rows.assign(time_us=us, per_layer_us=us).reset_index(drop=True)


def write_results(root: str | Path, hw: str = "synthetic-gpu", experiments=None, counters: bool = True,
                  bench: bool = True, validation: bool = True, e2e: bool = True, fp8: bool = False) -> Path:
    """Write a synthetic results/{hw}/ (+ results/counters/) tree under ``root``; returns results/{hw}.
    ``fp8``: also bench_kernels_fp8.parquet (fp8_bench_frame; the fp16 grid then names its kv_dtype)."""
    root = Path(root)
    hw_dir = root / "results" / hw
    frames = raw_frames()
    for name, frame in frames.items():
        if experiments is None or name in experiments:
            io.atomic_write_parquet(hw_dir / "raw" / f"{name}.parquet", frame)
            io.atomic_write_json(hw_dir / "raw" / f"{name}.json", provenance())
    if bench:
        grid = with_floor(bench_frame())
        if fp8:
            grid = grid.assign(kv_dtype=np.where(grid["protocol"] == "ceiling", "", "float16"))
            io.atomic_write_parquet(hw_dir / "bench_kernels_fp8.parquet", fp8_bench_frame(grid))
        io.atomic_write_parquet(hw_dir / "bench_kernels.parquet", grid)
        io.atomic_write_parquet(hw_dir / "bench_shapes.parquet", shapes_frame())
    if validation:
        io.atomic_write_parquet(hw_dir / "validation_gpu.parquet", validation_frame())
    io.atomic_write_json(hw_dir / "provenance.json", provenance())
    io.atomic_write_json(hw_dir / "policy.json", policy())
    if e2e:
        write_e2e(hw_dir)
    if counters:
        for name, frame in ablation_frames().items():
            io.atomic_write_parquet(root / "results" / "counters" / f"{name}.parquet", frame)
    return hw_dir


# -- the one-kernel floor and the shapes experiment (toy model, as above) ------------------------
FLOOR_FIXED_US = 2.5  #: the toy floor's launch, ramp-up and tail
SHAPES_BACKENDS = ("pkv-workqueue", "flashinfer-tc", "flashinfer-cc", "vllm-fa3", "trtllm-xqa")


def with_floor(frame: pd.DataFrame, seed: int = 3) -> pd.DataFrame:
    """``frame`` plus one-kernel-floor rows (backend names.FLOOR_BACKEND, protocol kernel) for each of its
    kernel cases, one per repeat: the toy floor FLOOR_FIXED_US + bytes at CEILING_GBPS, lognormal noise."""
    from persistentkv.names import FLOOR_BACKEND

    rng = np.random.default_rng(seed)
    kernel = frame[(frame["protocol"] == "kernel") & (frame["status"] == "ok")
                   & (frame["backend"] == "pkv-workqueue")]
    floor = kernel.copy()
    us = FLOOR_FIXED_US + floor["kv_bytes"].astype(float) / (CEILING_GBPS * 1e3)
    floor = floor.assign(backend=FLOOR_BACKEND, route="read-528x256", num_splits=-1,
                         time_us=us.to_numpy() * np.exp(rng.normal(0, 0.02, len(floor))))
    floor = floor.assign(per_layer_us=floor["time_us"],
                         frac_of_ceiling=floor["kv_bytes"] / floor["time_us"] / 1e3 / CEILING_GBPS,
                         reason="synthetic: toy floor")
    return pd.concat([frame, floor], ignore_index=True)


def shapes_frame(repeats: int = 3, seed: int = 4) -> pd.DataFrame:
    """bench_shapes.parquet: Hkv in {1, 2, 8} x G in {4, 8} x B in {1, 4, 16} x {4, 16, 64, 256} MiB, kernel
    rows of SHAPES_BACKENDS and the toy floor."""
    rng = np.random.default_rng(seed)
    rows = []
    for hkv in (1, 2, 8):
        for g in (4, 8):
            spec = AttentionSpec(g * hkv, hkv, 128, 16, "float16")
            for b in (1, 4, 16):
                for mib in (4, 16, 64, 256):
                    n = (mib << 20) // (b * spec.kv_bytes_per_token)
                    rows += _rows_for("bench_shapes", f"B{b}xN{n}", 0, [(0, [n] * b)], rng, ("kernel",), repeats,
                                      spec=spec, backends=SHAPES_BACKENDS)
    return with_floor(pd.DataFrame(rows), seed)
# -- the full decode step (results/{hw}/e2e/pass<N>.parquet) ------------------------------------------
E2E_RUN_ID = "synthetic-e2e"
#: Independent passes written (measure.e2e_passes); pass N has run_id E2E_RUN_ID-N and its own noise.
E2E_PASSES = 2
#: Two Llama-shaped decoders (the config's dimensions); their rows are toy times, not measurements.
E2E_MODELS = {
    "llama3_8b": dict(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, num_layers=32,
                      intermediate_size=14336, vocab_size=128256),
    "llama3_70b_tp8": dict(hidden_size=8192, num_heads=8, num_kv_heads=1, head_dim=128, num_layers=80,
                           intermediate_size=3584, vocab_size=16032, tensor_parallel=8),
}
#: model -> (B, context) cells, and the trace steps (name, step, lengths) of the first model.
E2E_CELLS = {"llama3_8b": [(1, 4096), (1, 32768), (16, 4096), (16, 32768)],
             "llama3_70b_tp8": [(1, 32768), (8, 32768)]}
E2E_TRACE_STEPS = [("zipf_b8", 0, [30000, 2000, 1500, 900, 700, 500, 400, 300]),
                   ("zipf_b8", 8, [30008, 2008, 1508, 908, 708, 508, 408, 308])]
E2E_BACKENDS = ("pkv-workqueue", "flashinfer-tc", "flashinfer-cc", "vllm-fa3", "trtllm-xqa")
E2E_UNAVAILABLE = {"trtllm-xqa": "synthetic: trtllm-xqa left out to keep the test data small"}
#: A cell the toy device cannot hold: its rows are refused, as measure-e2e refuses one.
E2E_REFUSED = ("llama3_8b", 64, 131072, "synthetic: needs more memory than the toy device has")


def _e2e_attention_us(backend: str, lengths, shape) -> float:
    """One step's attention over every layer in the toy model: each layer reads its K/V at the
    backend's fraction of the ceiling (_efficiency), plus a launch cost."""
    lengths = np.asarray(lengths)
    per_layer_kv = float(lengths.sum()) * 2 * shape.num_kv_heads * shape.head_dim * 2
    ragged = float(lengths.std() / lengths.mean()) if lengths.size > 1 else 0.0
    eff = _efficiency(backend, lengths.size, int(lengths.max()), min(ragged, 1.0), 0.0)
    return shape.num_layers * (per_layer_kv / (RUN_CEILING_GBPS * 1e3 * eff) + 4.0)


def e2e_models() -> dict:
    """The config's ``models:`` entries of E2E_MODELS (the shard's note as the config words it)."""
    note = ("synthetic: one GPU's shard at tensor parallelism 8; its all-reduces and the logits gather are not "
            "modelled on one GPU")
    return {name: {**dims, **({"note": note} if dims.get("tensor_parallel", 1) > 1 else {})}
            for name, dims in E2E_MODELS.items()}


def e2e_frame(repeats: int = 7, seed: int = 3, run_id: str = E2E_RUN_ID) -> pd.DataFrame:
    """One pass's rows (e2e/pass<N>.parquet): per model, cell (and two trace steps of the first model) and backend, the
    step and its attention in interleaved rounds (a noise factor shared by every backend's round,
    so the pairing by repeat matters), the non-attention part near its weight floor, ceiling rows,
    an unavailable backend and a refused cell."""
    from persistentkv.model.shape import ModelShape

    rng = np.random.default_rng(seed)
    rows = []
    base = {"run_id": run_id, "experiment": "e2e", "seed": CALIBRATION, "dtype": "float16", "page_size": 16,
            "kernels": "torch", "read_ceiling_gbps": RUN_CEILING_GBPS, "mem_estimate_bytes": 0, "recaptures": 0}
    for name, dims in E2E_MODELS.items():
        shape = ModelShape(name=name, **dims)
        configurations = [("cases", 0, [n] * b) for b, n in E2E_CELLS[name]]
        configurations += E2E_TRACE_STEPS if name == "llama3_8b" else []
        for trace, step, lengths in configurations:
            lengths = np.asarray(lengths)
            B = int(lengths.size)
            weight_bytes = shape.step_weight_bytes("float16", B)
            kv_bytes = int(lengths.sum()) * shape.kv_bytes_per_token("float16")
            weight_floor, kv_floor = weight_bytes / (RUN_CEILING_GBPS * 1e3), kv_bytes / (RUN_CEILING_GBPS * 1e3)
            rest = weight_floor / 0.86 + 6.0 * shape.num_layers + 2.0 * B      # GEMMs near the weight floor
            cell = {**base, "model": name, "tensor_parallel": shape.tensor_parallel, "trace": trace, "step": step,
                    "batch_size": B, "context": int(lengths.max()), "total_tokens": int(lengths.sum()),
                    "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "weight_floor_us": weight_floor,
                    "weight_kernel_floor_us": weight_floor / 0.9 + 2.0 * (4 * shape.num_layers + 1),
                    "kv_floor_us": kv_floor, "floor_us": weight_floor + kv_floor,
                    "mem_peak_bytes": shape.weight_bytes("float16") + 3 * kv_bytes}
            for r in range(repeats):
                shared = float(np.exp(rng.normal(0, 0.01)))                   # the round's machine state
                for backend in E2E_BACKENDS:
                    if backend in E2E_UNAVAILABLE:
                        continue
                    attn = _e2e_attention_us(backend, lengths, shape) * shared * float(np.exp(rng.normal(0, 0.004)))
                    step_us = attn + rest * shared * float(np.exp(rng.normal(0, 0.004)))
                    rows.append({**cell, "backend": backend, "repeat": r, "step_us": step_us, "attention_us": attn,
                                 "non_attention_us": step_us - attn,
                                 "rest_us": rest * shared * float(np.exp(rng.normal(0, 0.004))),
                                 "append_us": 1.5 * shape.num_layers * shared,
                                 "tokens_per_s": B / (step_us * 1e-6),
                                 "follow": "device" if backend.startswith("pkv") else "host",
                                 "status": "ok", "reason": ""})
            for backend, reason in E2E_UNAVAILABLE.items():
                rows.append({**cell, "backend": backend, "repeat": -1, "step_us": np.nan, "attention_us": np.nan,
                             "non_attention_us": np.nan, "rest_us": np.nan, "append_us": np.nan,
                             "tokens_per_s": np.nan, "follow": "",
                             "status": "unavailable", "reason": reason})
    name, B, context, reason = E2E_REFUSED
    shape = ModelShape(name=name, **E2E_MODELS[name])
    for backend in E2E_BACKENDS:
        rows.append({**base, "model": name, "tensor_parallel": 1, "trace": "cases", "step": 0, "batch_size": B,
                     "context": context, "total_tokens": B * context, "backend": backend, "repeat": -1,
                     "weight_bytes": shape.step_weight_bytes("float16", B),
                     "kv_bytes": B * context * shape.kv_bytes_per_token("float16"), "step_us": np.nan,
                     "attention_us": np.nan, "non_attention_us": np.nan, "rest_us": np.nan, "append_us": np.nan,
                     "tokens_per_s": np.nan, "follow": "", "mem_peak_bytes": 0, "status": "refused", "reason": reason})
    nbytes = 16 << 30
    rows += [{**base, "model": "", "tensor_parallel": 1, "trace": "read-ceiling", "step": 0, "batch_size": 0,
              "context": 0, "total_tokens": 0, "backend": "read-ceiling", "repeat": r, "kv_bytes": nbytes,
              "weight_bytes": 0, "step_us": CEILING_FIXED_US + nbytes / (CEILING_GBPS * 1e3),
              "follow": "", "kernels": "", "status": "ok", "reason": ""} for r in range(2 * 3)]
    return pd.DataFrame(rows)


def e2e_provenance(complete: bool = True, run_id: str = E2E_RUN_ID) -> dict:
    """A pass's sidecar: the run's record (the synthetic GPU's) with measure-e2e's completeness fields."""
    record = {**provenance()[RUN_ID], "command": "tests/synthetic.py (e2e)"}
    n = sum(len(c) for c in E2E_CELLS.values()) + len(E2E_TRACE_STEPS) + 1
    return {run_id: {**record, "complete": complete,
                     "configurations": {"done": n if complete else n - 1, "total": n}}}


def write_e2e(hw_dir: str | Path, complete: bool = True, passes: int = E2E_PASSES) -> list[Path]:
    """Write results/{hw}/e2e/pass<N>.parquet and .json for N = 1..passes (synthetic; the last pass
    partial unless ``complete``); returns the parquets' paths."""
    out = []
    for n in range(1, passes + 1):
        path, run_id = Path(hw_dir) / "e2e" / f"pass{n}.parquet", f"{E2E_RUN_ID}-{n}"
        io.atomic_write_parquet(path, e2e_frame(seed=3 + n, run_id=run_id))
        io.atomic_write_json(path.with_suffix(".json"), e2e_provenance(complete or n < passes, run_id))
        out.append(path)
    return out
