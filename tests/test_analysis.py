"""persistentkv.analysis: medians, paired ratios, references, geometric means, intervals."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persistentkv import analysis
from persistentkv.errors import PKVError


def rows(times: dict, experiment="published", trace="t", seed=1, protocol="step", noise=0.0, rng_seed=0,
         tokens=None, **extra) -> pd.DataFrame:
    """Tidy timing rows: times = {backend: [[repeat values] per step]} (None: step missing)."""
    rng = np.random.default_rng(rng_seed)
    out = []
    for backend, per_step in times.items():
        for step, reps in enumerate(per_step):
            if reps is None:
                continue
            for r, t in enumerate(reps):
                out.append({"experiment": experiment, "trace": trace, "seed": seed, "protocol": protocol,
                            "step": step, "repeat": r, "backend": backend, "status": "ok",
                            "time_us": float(t) * float(np.exp(rng.normal(0, noise))) if noise else float(t),
                            "total_tokens": (tokens or [1000] * len(per_step))[step], **extra})
    return pd.DataFrame(out)


def const(value, steps=4, repeats=3):
    return [[value] * repeats for _ in range(steps)]


def one_ratio(frame, backend, reference="flashinfer-best"):
    r = analysis.ratios(analysis.bootstrap_cells(frame), reference, backends=[backend])
    assert len(r) == 1
    return r.iloc[0]


def test_exact_ratio_and_degenerate_interval():
    frame = rows({"flashinfer-tc": const(100.0), "pkv-workqueue": const(50.0)})
    r = one_ratio(frame, "pkv-workqueue")
    assert r["ratio"] == pytest.approx(2.0)
    assert r["lo"] == pytest.approx(2.0) and r["hi"] == pytest.approx(2.0)
    assert r["ref_backend"] == "flashinfer-tc"


def test_step_median_then_mean_over_steps():
    # Step medians: A = 10, 30 -> mean 20; B = 5, 5 -> 5; one wild repeat must not move a median.
    frame = rows({"flashinfer-cc": [[10, 10, 1000], [30, 30, 29]], "pkv-split": [[5, 5, 5], [5, 4, 6]]})
    cells = analysis.bootstrap_cells(frame)
    assert cells[0].time("flashinfer-cc")[0] == pytest.approx((10 + 30) / 2)
    assert one_ratio(frame, "pkv-split")["ratio"] == pytest.approx(4.0)


def test_ratio_uses_only_steps_both_backends_have():
    a = [[10.0] * 3, [20.0] * 3, [30.0] * 3, [40.0] * 3]
    b = [[5.0] * 3, [10.0] * 3, None, None]
    r = one_ratio(rows({"flashinfer-tc": a, "pkv-buckets": b}), "pkv-buckets")
    assert r["ratio"] == pytest.approx(2.0)       # (10+20)/2 over (5+10)/2, not (10..40)/4 over 7.5
    assert r["n_steps"] == 2
    assert r["lo"] == pytest.approx(2.0) and r["hi"] == pytest.approx(2.0)


def test_flashinfer_best_is_chosen_per_cell():
    frame = pd.concat([
        rows({"flashinfer-cc": const(80.0), "flashinfer-tc": const(100.0), "pkv-workqueue": const(40.0)}, seed=1),
        rows({"flashinfer-cc": const(120.0), "flashinfer-tc": const(100.0), "pkv-workqueue": const(40.0)}, seed=2),
    ])
    r = analysis.ratios(analysis.bootstrap_cells(frame), "flashinfer-best", backends=["pkv-workqueue"])
    r = r.set_index("seed")
    assert r.loc[1, "ref_backend"] == "flashinfer-cc" and r.loc[1, "ratio"] == pytest.approx(2.0)
    assert r.loc[2, "ref_backend"] == "flashinfer-tc" and r.loc[2, "ratio"] == pytest.approx(2.5)


def test_baseline_best_includes_other_libraries():
    frame = rows({"flashinfer-tc": const(100.0), "vllm-fa3": const(50.0), "trtllm-xqa": const(70.0),
                  "pkv-workqueue": const(50.0)})
    r = one_ratio(frame, "pkv-workqueue", "baseline-best")
    assert r["ref_backend"] == "vllm-fa3" and r["ratio"] == pytest.approx(1.0)


def test_missing_reference_gives_no_row():
    frame = rows({"pkv-workqueue": const(50.0), "vllm-fa3": const(60.0)})
    assert analysis.ratios(analysis.bootstrap_cells(frame), "flashinfer-best").empty


def test_interval_covers_truth_and_is_deterministic():
    truth = 1.25
    steps = 12
    base = [[100.0 + 10 * s] * 5 for s in range(steps)]
    fast = [[(100.0 + 10 * s) / truth] * 5 for s in range(steps)]
    frame = rows({"flashinfer-tc": base, "pkv-workqueue": fast}, noise=0.05, rng_seed=3)
    r1 = one_ratio(frame, "pkv-workqueue")
    assert r1["lo"] < truth < r1["hi"]
    assert r1["hi"] - r1["lo"] < 0.15
    # Same rows in another order (and beside another cell): the same interval, to the bit.
    other = rows({"flashinfer-tc": const(1.0), "pkv-workqueue": const(2.0)}, trace="other")
    shuffled = pd.concat([other, frame.sample(frac=1.0, random_state=1)])
    r2 = analysis.ratios(analysis.bootstrap_cells(shuffled), backends=["pkv-workqueue"])
    r2 = r2[r2["trace"] == "t"].iloc[0]
    assert (r1["ratio"], r1["lo"], r1["hi"]) == (r2["ratio"], r2["lo"], r2["hi"])


def test_noisier_data_gives_wider_intervals():
    steps = [[100.0] * 5 for _ in range(10)]
    quiet = one_ratio(rows({"flashinfer-tc": steps, "pkv-split": steps}, noise=0.01, rng_seed=5), "pkv-split")
    loud = one_ratio(rows({"flashinfer-tc": steps, "pkv-split": steps}, noise=0.10, rng_seed=5), "pkv-split")
    assert (loud["hi"] - loud["lo"]) > 3 * (quiet["hi"] - quiet["lo"])


def test_geomean_of_rows():
    frame = pd.concat([rows({"flashinfer-tc": const(200.0), "pkv-workqueue": const(100.0)}, seed=1),
                       rows({"flashinfer-tc": const(800.0), "pkv-workqueue": const(100.0)}, seed=2)])
    per = analysis.ratios(analysis.bootstrap_cells(frame), backends=["pkv-workqueue"])
    g = analysis.geomean(per).iloc[0]
    assert g["ratio"] == pytest.approx(4.0)
    assert g["n_rows"] == 2
    # Resampling two seeds spans the pair: the interval reaches from one toward the other.
    assert 2.0 - 1e-9 <= g["lo"] <= 4.0 <= g["hi"] <= 8.0 + 1e-9
    assert g["hi"] - g["lo"] > 1.0


def test_geomean_grouped():
    frame = pd.concat([rows({"flashinfer-tc": const(200.0), "pkv-workqueue": const(100.0)}, trace=t, seed=s)
                       for t in ("a", "b") for s in (1, 2)])
    per = analysis.ratios(analysis.bootstrap_cells(frame), backends=["pkv-workqueue"])
    g = analysis.geomean(per, by=["trace"])
    assert list(g["trace"]) == ["a", "b"]
    assert np.allclose(g["ratio"], 2.0)


def test_split_counts_are_not_pooled():
    frame = pd.concat([rows({"pkv-split": const(50.0)}, num_splits=8), rows({"pkv-split": const(25.0)}, num_splits=32),
                       rows({"flashinfer-tc": const(100.0)}, num_splits=-1)])
    r = analysis.ratios(analysis.bootstrap_cells(frame)).set_index("backend")
    assert r.loc["pkv-split/S8", "ratio"] == pytest.approx(2.0)
    assert r.loc["pkv-split/S32", "ratio"] == pytest.approx(4.0)


def test_unavailable_and_nan_rows_are_ignored():
    frame = rows({"flashinfer-tc": const(100.0), "pkv-workqueue": const(50.0)})
    bad = pd.DataFrame([{**frame.iloc[0].to_dict(), "backend": "vllm-fa3", "status": "unavailable", "time_us": np.nan},
                        {**frame.iloc[0].to_dict(), "backend": "pkv-workqueue", "time_us": np.nan}])
    cells = analysis.bootstrap_cells(pd.concat([frame, bad]))
    assert cells[0].backends == ["flashinfer-tc", "pkv-workqueue"]
    assert one_ratio(pd.concat([frame, bad]), "pkv-workqueue")["ratio"] == pytest.approx(2.0)


def test_bad_input_is_a_one_line_error():
    with pytest.raises(PKVError, match="unknown metric 'cuda_us'"):
        analysis.bootstrap_cells(rows({"a": const(1.0)}), metric="cuda_us")
    with pytest.raises(PKVError, match="lack column"):
        analysis.bootstrap_cells(rows({"a": const(1.0)}).drop(columns="repeat"))
    with pytest.raises(PKVError, match="n_boot"):
        analysis.bootstrap_cells(rows({"a": const(1.0)}), n_boot=3)
    assert analysis.bootstrap_cells(pd.DataFrame()) == []


def test_ceiling_fraction_from_column_or_computed():
    frame = rows({"flashinfer-tc": const(100.0)}, protocol="kernel")
    frame["kv_bytes"] = 226_000_000                      # 226 MB in 100 us = 2260 GB/s
    frame["per_layer_us"] = frame["time_us"]
    frame["read_ceiling_gbps"] = 4520.0
    got = analysis.ceiling_fraction(frame).iloc[0]
    assert got["frac"] == pytest.approx(0.5)
    frame["frac_of_ceiling"] = 0.25                      # a recorded value wins over the recomputation
    assert analysis.ceiling_fraction(frame).iloc[0]["frac"] == pytest.approx(0.25)


def test_fastest_member_and_split_labels():
    frame = rows({"pkv-split": const(90.0), "pkv-workqueue": const(100.0), "flashinfer-tc": const(80.0)})
    sweep = pd.concat([rows({"pkv-split": const(100.0 + s)}, num_splits=s) for s in (8, 16)], ignore_index=True)
    (cell,) = analysis.bootstrap_cells(frame)
    assert cell.fastest(["pkv-workqueue", "pkv-split", "pkv-buckets"]) == "pkv-split"
    assert cell.fastest(["pkv-buckets"]) is None and cell.resolve("flashinfer-best") == "flashinfer-tc"
    (swept,) = analysis.bootstrap_cells(sweep)
    assert swept.backends == ["pkv-split/S16", "pkv-split/S8"]
    assert {analysis.unlabelled(b) for b in swept.backends} == {"pkv-split"}
    assert analysis.unlabelled("vllm-fa3") == "vllm-fa3"


def test_corrected_interval_widens_with_the_number_of_tests():
    rng = np.random.default_rng(5)
    boot = np.exp(rng.normal(np.log(1.05), 0.01, 4000))
    lo1, hi1 = analysis.corrected_interval(1.05, boot, 1)
    # one test: the normal 95 % interval, close to the bootstrap's own percentiles
    assert lo1 == pytest.approx(np.quantile(boot, 0.025), rel=2e-3)
    assert hi1 == pytest.approx(np.quantile(boot, 0.975), rel=2e-3)
    lo, hi = analysis.corrected_interval(1.05, boot, 1000)
    assert lo < lo1 < 1.05 < hi1 < hi
    z = np.log(hi / 1.05) / np.log(hi1 / 1.05)                  # z(0.025 / 1000) / z(0.025) = 4.06 / 1.96
    assert z == pytest.approx(4.0556 / 1.95996, rel=0.01)
    assert np.log(1.05 / lo) == pytest.approx(np.log(hi / 1.05))  # symmetric on the log scale
    assert all(np.isnan(analysis.corrected_interval(1.05, np.array([1.05, np.nan]), 3)))
    with pytest.raises(PKVError, match="tests must be a positive integer"):
        analysis.corrected_interval(1.05, boot, 0)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.floats(1.0, 1e4), min_size=2, max_size=4), min_size=1, max_size=6),
       st.floats(0.1, 10.0))
def test_ratio_is_scale_free_and_one_against_itself(times, scale):
    n_rep = min(len(t) for t in times)
    times = [t[:n_rep] for t in times]
    frame = rows({"flashinfer-tc": times, "pkv-split": [[v * scale for v in t] for t in times]})
    cells = analysis.bootstrap_cells(frame, n_boot=50)
    r = analysis.ratios(cells, backends=["pkv-split", "flashinfer-tc"]).set_index("backend")
    assert r.loc["flashinfer-tc", "ratio"] == pytest.approx(1.0)
    assert r.loc["pkv-split", "ratio"] == pytest.approx(1.0 / scale)
    lo, hi = r.loc["pkv-split", "lo"], r.loc["pkv-split", "hi"]
    assert 0 < lo <= hi < np.inf
