"""targets.floor_verdicts: pkv-workqueue against the one-kernel floor and on the shapes grid, each
check on constructed rows where it holds, where it fails, and without rows ("not measured")."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import synthetic
from persistentkv import targets
from persistentkv.measure.rows import raw_frame, raw_row
from persistentkv.names import FLOOR_BACKEND, SHAPES_EXPERIMENT
from persistentkv.results import Results

MiB = 2**20
OURS = targets.ENGINE_BACKEND


def rows(experiment: str, hkv: int, g: int, batch: int, mib: float, times: dict, repeats: int = 5, seed: int = 0):
    """Kernel rows of one case: B rows reading ``mib`` MiB at Hkv, G (head_dim 128, fp16); ``times``:
    backend -> median us (1 % lognormal noise around it)."""
    rng = np.random.default_rng([seed, hkv, g, batch, int(mib * 16)])
    kv = int(mib * MiB)
    n = kv // (batch * hkv * 512)
    out = []
    for backend, t in times.items():
        for r in range(repeats):
            out.append(raw_row(run_id="run-t", experiment=experiment, trace=f"B{batch}xN{n}", seed=0, step=0,
                               batch_size=batch, max_len=n, total_tokens=n * batch, kv_bytes=kv,
                               num_qo_heads=g * hkv, num_kv_heads=hkv, head_dim=128, page_size=16, dtype="float16",
                               hole_fraction=0.0, backend=backend, route=backend, protocol="kernel", repeat=r,
                               time_us=t * float(np.exp(rng.normal(0, 0.01))), per_layer_us=t, status="ok"))
    return out


def results(bench=(), shapes=()) -> Results:
    empty = pd.DataFrame()
    frame = lambda rs: raw_frame(list(rs)) if rs else empty  # noqa: E731
    return Results(hw="test-gpu", raw=empty, bench=frame(bench), validation_gpu=empty, validation_cpu=empty,
                   ablation_buckets=empty, ablation_splits=empty, provenance={}, policy=None, kernels=None,
                   config=synthetic.config(), shapes=frame(shapes))


def test_floor_bands_are_explicit():
    assert targets.floor_band(4 * MiB) is None
    assert targets.floor_band(16 * MiB) == 0.75
    assert targets.floor_band(32 * MiB) == targets.floor_band(64 * MiB) == 0.85
    assert targets.floor_band(128 * MiB) == 0.90
    assert targets.floor_band(256 * MiB) == targets.floor_band(4096 * MiB) == 0.95


def test_nothing_measured_says_so_for_every_check():
    out = targets.floor_verdicts(results())
    for key in ("floor", "invariance", "baselines", "small_heads"):
        assert out[key]["verdict"] == targets.NOT_MEASURED, key
    assert all("not measured" in s for s in out["sentences"])
    json.dumps(out)
    # bench rows without the floor: the floor check is still not measured
    out = targets.floor_verdicts(results(bench=rows("bench_kernels", 8, 4, 1, 64, {OURS: 20.0, "flashinfer-tc": 25.0})))
    assert out["floor"]["verdict"] == targets.NOT_MEASURED


def floor_case(mib, frac, experiment="bench_kernels", hkv=8, g=4, batch=1):
    floor_us = 3.0 + mib * MiB / 4.5e9 * 1e6
    return rows(experiment, hkv, g, batch, mib, {OURS: floor_us / frac, FLOOR_BACKEND: floor_us})


def test_floor_holds_when_every_band_is_reached():
    bench = (floor_case(4, 0.5) + floor_case(16, 0.8) + floor_case(64, 0.88) + floor_case(128, 0.93)
             + floor_case(512, 0.97))
    out = targets.floor_verdicts(results(bench=bench))
    f = out["floor"]
    assert f["verdict"] == targets.HOLDS and not f["below"]
    assert len(f["cases"]) == 5 and sum(e["target"] is not None for e in f["cases"]) == 4
    small = next(e for e in f["cases"] if e["kv_bytes"] == 4 * MiB)
    assert small["target"] is None and small["frac"] == pytest.approx(0.5, rel=0.03)   # listed, not judged
    for e in f["cases"]:
        assert e["lo"] <= e["frac"] <= e["hi"]
        assert e["floor_us"] / e["ours_us"] == pytest.approx(e["frac"], rel=1e-9)


def test_floor_fails_where_one_band_falls_short_even_at_other_shapes():
    bench = floor_case(16, 0.8) + floor_case(256, 0.97)
    shapes = floor_case(256, 0.90, SHAPES_EXPERIMENT, hkv=1, g=8, batch=4)
    out = targets.floor_verdicts(results(bench=bench, shapes=shapes))
    f = out["floor"]
    assert f["verdict"] == targets.FAILS
    assert f["below"] == [e["case"] for e in f["cases"] if e["source"] == SHAPES_EXPERIMENT]
    assert f["significantly_below"] == f["below"]   # 0.90 with 1 % noise: the interval is clear of 0.95
    assert "does not hold" in out["sentences"][0]


def shapes_pair(t_small, t_ref, mib=16, g=4, batch=4, small=1, baseline=None):
    extra = {"flashinfer-tc": baseline} if baseline else {}
    return (rows(SHAPES_EXPERIMENT, small, g, batch, mib, {OURS: t_small, **extra})
            + rows(SHAPES_EXPERIMENT, 8, g, batch, mib, {OURS: t_ref, **extra}))


def test_invariance_holds_within_the_bound_and_fails_beyond_it():
    out = targets.floor_verdicts(results(shapes=shapes_pair(11.0, 10.0) + shapes_pair(10.5, 10.0, small=2, mib=64)))
    inv = out["invariance"]
    assert inv["verdict"] == targets.HOLDS and len(inv["pairs"]) == 2
    p = next(p for p in inv["pairs"] if p["num_kv_heads"] == 1)
    assert p["ratio"] == pytest.approx(1.1, rel=0.02) and p["lo"] <= p["ratio"] <= p["hi"]
    assert "Hkv=8" in p["reference"] and p["kv_bytes"] == 16 * MiB
    out = targets.floor_verdicts(results(shapes=shapes_pair(12.5, 10.0) + shapes_pair(10.5, 10.0, small=2, mib=64)))
    assert out["invariance"]["verdict"] == targets.FAILS and len(out["invariance"]["above"]) == 1


def test_invariance_pairs_only_equal_g_b_and_bytes_from_4_mib():
    # the reference at another B, another G or other bytes is no reference; below 4 MiB is not judged
    shapes = (rows(SHAPES_EXPERIMENT, 1, 4, 4, 16, {OURS: 30.0}) + rows(SHAPES_EXPERIMENT, 8, 4, 1, 16, {OURS: 10.0})
              + rows(SHAPES_EXPERIMENT, 8, 8, 4, 16, {OURS: 10.0}) + rows(SHAPES_EXPERIMENT, 8, 4, 4, 64, {OURS: 10.0})
              + rows(SHAPES_EXPERIMENT, 1, 4, 1, 2, {OURS: 30.0}) + rows(SHAPES_EXPERIMENT, 8, 4, 1, 2, {OURS: 3.0}))
    out = targets.floor_verdicts(results(shapes=shapes))
    assert out["invariance"]["verdict"] == targets.NOT_MEASURED and not out["invariance"]["pairs"]


def test_baselines_hold_and_fail_on_the_shapes_grid():
    # Hkv=1 at 16 MiB 1.6x the baseline, Hkv=8 at 16 MiB even, Hkv=1 at 256 MiB even (not in the 1.5x set)
    good = (rows(SHAPES_EXPERIMENT, 1, 4, 1, 16, {OURS: 10.0, "flashinfer-tc": 16.0, "vllm-fa3": 20.0})
            + rows(SHAPES_EXPERIMENT, 8, 4, 1, 16, {OURS: 10.0, "flashinfer-tc": 10.0})
            + rows(SHAPES_EXPERIMENT, 1, 4, 1, 256, {OURS: 60.0, "trtllm-xqa": 60.0}))
    out = targets.floor_verdicts(results(shapes=good))
    assert out["baselines"]["verdict"] == targets.HOLDS and len(out["baselines"]["cases"]) == 3
    small = out["small_heads"]
    assert small["verdict"] == targets.HOLDS and [c["num_kv_heads"] for c in small["cases"]] == [1]
    assert small["cases"][0]["baseline"] == "flashinfer-tc" and small["cases"][0]["ratio"] == pytest.approx(1.6, rel=0.02)
    bad = (rows(SHAPES_EXPERIMENT, 2, 8, 4, 64, {OURS: 10.0, "flashinfer-tc": 12.0})       # 1.2x < 1.5x
           + rows(SHAPES_EXPERIMENT, 8, 8, 4, 64, {OURS: 10.0, "flashinfer-cc": 9.0}))     # 0.9x < 0.98x
    out = targets.floor_verdicts(results(shapes=bad))
    assert out["small_heads"]["verdict"] == targets.FAILS and out["baselines"]["verdict"] == targets.FAILS
    assert len(out["baselines"]["below"]) == 1 and "Hkv=8" in out["baselines"]["below"][0]
    # only our rows: against the baselines is not measured
    out = targets.floor_verdicts(results(shapes=rows(SHAPES_EXPERIMENT, 1, 4, 1, 16, {OURS: 10.0})))
    assert out["baselines"]["verdict"] == out["small_heads"]["verdict"] == targets.NOT_MEASURED


def test_the_synthetic_results_give_every_check_a_verdict():
    import tempfile
    from pathlib import Path

    from persistentkv.results import load_results

    hw = synthetic.write_results(Path(tempfile.mkdtemp()))
    out = targets.floor_verdicts(load_results(hw, config=synthetic.config()))
    assert all(out[k]["verdict"] != targets.NOT_MEASURED for k in ("floor", "invariance", "baselines", "small_heads"))
    assert {e["source"] for e in out["floor"]["cases"]} == {"bench_kernels", SHAPES_EXPERIMENT}
    json.dumps(out)
