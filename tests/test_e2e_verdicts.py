"""The full decode step's verdicts (targets.e2e_verdicts) on constructed rows: each rule where it
holds and where it fails, the pairing of rounds, rows that did not run, and no rows at all."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from persistentkv import analysis, claims, targets
from persistentkv.results import Results

MODEL, KERNELS = "llama3_8b", "torch"


def results_of(frame: pd.DataFrame, provenance: dict | None = None) -> Results:
    empty = pd.DataFrame()
    return Results(hw="test-gpu", raw=empty, bench=empty, validation_gpu=empty, validation_cpu=empty,
                   ablation_buckets=empty, ablation_splits=empty, provenance=provenance or {"run": {}},
                   policy=None, kernels=None, e2e=frame)


def cell_rows(times: dict, batch_size: int = 4, context: int = 32768, rounds: int = 9, factors=None,
              weight_floor_us: float = 500.0, trace: str = "cases", step: int = 0, run_id: str = "run") -> list[dict]:
    """Rows of one cell: backend -> (step_us, attention_us), each round scaled by factors[r] (the
    round's shared machine state; 1 by default)."""
    factors = np.ones(rounds) if factors is None else np.asarray(factors)
    rows = []
    for backend, (step_us, attn_us) in times.items():
        for r in range(rounds):
            s, a = step_us * factors[r], attn_us * factors[r]
            rows.append({"run_id": run_id, "model": MODEL, "kernels": KERNELS, "trace": trace, "step": step,
                         "batch_size": batch_size, "context": context, "backend": backend, "repeat": r,
                         "step_us": s, "attention_us": a, "non_attention_us": s - a,
                         "tokens_per_s": batch_size / (s * 1e-6), "weight_floor_us": weight_floor_us,
                         "floor_us": weight_floor_us + 100.0, "mem_peak_bytes": 2**34, "status": "ok", "reason": ""})
    return rows


def verdicts(rows: list[dict], provenance: dict | None = None) -> dict:
    return targets.e2e_verdicts(results_of(pd.DataFrame(rows), provenance))


def test_step_min_ratio_holds_at_the_fastest_baseline_and_fails_below_it():
    ok = verdicts(cell_rows({"pkv-workqueue": (1005.0, 200.0), "flashinfer-tc": (1000.0, 200.0),
                             "vllm-fa3": (1200.0, 300.0)}))
    (cell,) = ok["cells"]
    assert cell["baseline"] == "flashinfer-tc" and cell["ratio"] == pytest.approx(1000 / 1005)
    assert ok["step"]["holds"] and cell["holds"] and cell["interval_clears"]
    slow = verdicts(cell_rows({"pkv-workqueue": (1030.0, 200.0), "flashinfer-tc": (1000.0, 200.0)}))
    assert not slow["step"]["holds"] and slow["step"]["below"] == [slow["cells"][0]["label"]]
    assert slow["step"]["significantly_below"] == slow["step"]["below"]
    assert "does not hold" in slow["sentences"][0]


def test_gain_reaches_its_amdahl_prediction_or_falls_short():
    # best: 1000 us a step, 300 of it attention; ours: 150 us of attention -> 1000 / 850 predicted
    kept = verdicts(cell_rows({"pkv-workqueue": (850.0, 150.0), "flashinfer-tc": (1000.0, 300.0)}))
    (cell,) = kept["cells"]
    assert cell["amdahl"] == pytest.approx(1000 / 850) and cell["ratio"] == pytest.approx(1000 / 850)
    assert cell["reaches_prediction"] and cell["interval"] == "rounds" and cell["passes"] == 1
    assert {k: kept["gain"][k] for k in ("cells", "reached", "short", "holds", "over_passes", "spread")} == \
        {"cells": 1, "reached": 1, "short": [], "holds": True, "over_passes": 0, "spread": None}
    assert "one pass" in kept["sentences"][1]
    assert cell["attention_share"] == pytest.approx(150 / 850)
    # the same attention gain, but the step outside attention got slower: the gain did not survive
    lost = verdicts(cell_rows({"pkv-workqueue": (950.0, 150.0), "flashinfer-tc": (1000.0, 300.0)}))
    (cell,) = lost["cells"]
    assert cell["ratio"] == pytest.approx(1000 / 950) and cell["hi"] < cell["amdahl_lo"]
    assert not lost["gain"]["holds"] and lost["gain"]["short"] == [cell["label"]]
    # the claim asks it of every cell: one short cell of two fails it
    both = verdicts(cell_rows({"pkv-workqueue": (850.0, 150.0), "flashinfer-tc": (1000.0, 300.0)}, batch_size=1)
                    + cell_rows({"pkv-workqueue": (950.0, 150.0), "flashinfer-tc": (1000.0, 300.0)}))
    assert both["gain"]["reached"] == 1 and not both["gain"]["holds"]


def passes_of(short_by: dict, batch_size: int = 4) -> list[dict]:
    """One cell's rows over passes: pass name -> how much ours' step is slower than its prediction
    (e: ours 850 (1 + e) us with 150 of attention against 1000 and 300, so measured over
    predicted is 1 / (1 + e) in that pass)."""
    return [row for run, e in short_by.items()
            for row in cell_rows({"pkv-workqueue": (850.0 * (1 + e), 150.0), "flashinfer-tc": (1000.0, 300.0)},
                                 batch_size=batch_size, run_id=run)]


def test_pass_intervals_pool_the_spread_and_hold_together():
    out, spread = analysis.pass_intervals({"a": [0.0, 2.0], "b": [1.0, 3.0], "one": [5.0]})
    # deviations +-1 in both cells: s^2 = 4 / 2; two cells at 95 % together -> t(1 - 0.0125, 2 df)
    assert spread.df == 2 and spread.cells == 2 and spread.sd == pytest.approx(2 ** 0.5)
    assert spread.q == pytest.approx(6.2053, abs=1e-3)
    assert out["a"] == pytest.approx((1.0, 1.0 - spread.q, 1.0 + spread.q))
    assert out["b"][0] == pytest.approx(2.0) and "one" not in out   # a cell of one pass is not judged here
    # eight cells judged together: each interval's tails are 0.05 / 16 (Bonferroni), on 8 df
    _, wide = analysis.pass_intervals({k: [0.0, 2.0] for k in "abcdefgh"})
    assert wide.cells == 8 and wide.df == 8 and wide.q == pytest.approx(stats.t.ppf(1 - 0.05 / 16, 8))
    assert wide.q > stats.t.ppf(1 - 0.05 / 2, 8)   # wider than one cell's 95 % interval
    assert analysis.pass_intervals({"a": [1.0]}) == ({}, None)


def test_gain_over_passes_is_judged_from_the_pass_to_pass_spread():
    # B=4: 0.2 % short on average, passes 0.5 % apart; B=1: 3 % short, with the same spread
    rows = (passes_of({"p1": 0.007, "p2": 0.002, "p3": -0.003})
            + passes_of({"p1": 0.035, "p2": 0.030, "p3": 0.025}, batch_size=1))
    out = verdicts(rows)
    by = {c["batch_size"]: c for c in out["cells"]}
    near, far = by[4], by[1]
    assert near["passes"] == far["passes"] == 3 and near["interval"] == far["interval"] == "passes"
    assert near["gap"] == pytest.approx(np.exp(-np.mean(np.log([1.007, 1.002, 0.997]))))
    assert near["ratio"] == pytest.approx(np.exp(np.mean(np.log(1000 / (850 * np.array([1.007, 1.002, 0.997]))))))
    assert near["amdahl"] == pytest.approx(1000 / 850)
    spread = out["gain"]["spread"]
    assert spread["cells"] == 2 and spread["df"] == 4
    assert near["gap_lo"] < near["gap"] < 1.0 < near["gap_hi"] and near["reaches_prediction"]
    assert far["gap_hi"] < 1.0 and not far["reaches_prediction"]
    assert not out["gain"]["holds"] and out["gain"]["short"] == [far["label"]] and out["gain"]["over_passes"] == 2
    assert [p["run_ids"] for p in near["per_pass"]] == [["p1"], ["p2"], ["p3"]]
    assert "3 independent passes" in out["sentences"][1] and "does not hold" in out["sentences"][1]
    assert f"short: {far['label']} (below it in 3 of 3 passes)." in out["sentences"][1]
    # the same three passes without the far cell: the claim holds
    alone = verdicts(passes_of({"p1": 0.007, "p2": 0.002, "p3": -0.003}))
    assert alone["gain"]["holds"] and alone["gain"]["reached"] == 1


def test_passes_of_different_builds_are_said():
    rows = passes_of({"p1": 0.0, "p2": 0.004})
    same = verdicts(rows, {"p1": {"git_commit": "abc1234"}, "p2": {"git_commit": "abc1234"}})
    assert same["commits"] == ["abc1234"] and not any("Mixed builds" in s for s in same["sentences"])
    mixed = verdicts(rows, {"p1": {"git_commit": "abc1234"}, "p2": {"git_commit": "def5678"}})
    assert mixed["commits"] == ["abc1234", "def5678"]
    assert any(s.startswith("Mixed builds: the passes judged together come from commits abc1234, def5678")
               for s in mixed["sentences"])


def test_a_cell_one_pass_reached_is_judged_over_its_rounds():
    rows = passes_of({"p1": 0.0, "p2": 0.004}) + passes_of({"p1": 0.05}, batch_size=1)
    out = verdicts(rows)
    by = {c["batch_size"]: c for c in out["cells"]}
    assert by[4]["interval"] == "passes" and by[1]["interval"] == "rounds" and by[1]["passes"] == 1
    assert not by[1]["reaches_prediction"] and out["gain"]["over_passes"] == 1
    assert "1 cell(s) of one pass judged over their rounds" in out["sentences"][1]


def test_rounds_are_resampled_paired_by_repeat():
    """Every backend's round r shares the machine state of round r: a ratio constant round by round
    has a zero-width interval however much the rounds differ from each other."""
    factors = np.linspace(0.8, 1.25, 9)[[3, 7, 0, 5, 8, 1, 6, 2, 4]]
    out = verdicts(cell_rows({"pkv-workqueue": (1000.0, 200.0), "flashinfer-tc": (1050.0, 260.0)}, factors=factors))
    (cell,) = out["cells"]
    assert cell["lo"] == pytest.approx(1.05) and cell["hi"] == pytest.approx(1.05)
    point, boot = analysis.paired_medians(np.vstack([factors, 2 * factors]), ("k",))
    assert np.allclose(boot[:, 1] / boot[:, 0], 2.0) and point[1] == pytest.approx(2 * np.median(factors))


def test_the_reference_is_the_fastest_of_the_baselines_only():
    """Another backend in the cell (torch-sdpa here, faster than every baseline) is never the
    reference: the step's minimum ratio compares ours with the fastest of names.BASELINES."""
    out = verdicts(cell_rows({"pkv-workqueue": (1000.0, 200.0), "torch-sdpa": (900.0, 100.0),
                              "vllm-fa3": (1150.0, 350.0), "flashinfer-tc": (1100.0, 300.0)}))
    (cell,) = out["cells"]
    assert cell["baseline"] == "flashinfer-tc" and cell["ratio"] == pytest.approx(1.1)


def test_non_attention_at_b1_against_its_weight_floor():
    near = verdicts(cell_rows({"pkv-workqueue": (1100.0, 200.0), "flashinfer-tc": (1150.0, 250.0)}, batch_size=1,
                              weight_floor_us=800.0)
                    # B=4 rows do not count towards the B=1 rule
                    + cell_rows({"pkv-workqueue": (9000.0, 200.0), "flashinfer-tc": (9000.0, 200.0)},
                                weight_floor_us=800.0))
    (rest,) = near["rest"]
    assert rest["frac"] == pytest.approx(800 / 900) and rest["holds"] and rest["rows"] == 18
    far = verdicts(cell_rows({"pkv-workqueue": (1300.0, 200.0), "flashinfer-tc": (1350.0, 250.0)}, batch_size=1,
                             weight_floor_us=800.0))
    assert far["rest"][0]["frac"] == pytest.approx(800 / 1100) and not far["rest"][0]["holds"]


def test_rows_that_did_not_run_are_listed_and_never_counted():
    rows = cell_rows({"pkv-workqueue": (1000.0, 200.0), "flashinfer-tc": (1010.0, 210.0)})
    # a failed baseline whose time would make it the fastest, and an unavailable one without times
    rows.append({**rows[-1], "backend": "vllm-fa3", "repeat": -1, "step_us": 1.0, "attention_us": 0.5,
                 "status": "failed", "reason": "graph capture failed"})
    rows.append({**rows[-1], "backend": "trtllm-xqa", "step_us": np.nan, "attention_us": np.nan,
                 "status": "unavailable", "reason": "no flashinfer"})
    refused = cell_rows({"pkv-workqueue": (1.0, 1.0), "flashinfer-tc": (1.0, 1.0)}, batch_size=64, context=131072,
                        rounds=1)
    rows += [{**r, "repeat": -1, "status": "refused", "reason": "needs 200 GiB, 130 GiB free"} for r in refused]
    out = verdicts(rows)
    assert [c["label"] for c in out["cells"]] == [f"{MODEL}/{KERNELS} B=4 x 32768"]
    assert out["cells"][0]["baseline"] == "flashinfer-tc"
    groups = {(n["status"], n["reason"]): n for n in out["not_run"]}
    assert groups[("failed", "graph capture failed")]["backends"] == ["vllm-fa3"]
    assert groups[("unavailable", "no flashinfer")]["backends"] == ["trtllm-xqa"]
    assert groups[("refused", "needs 200 GiB, 130 GiB free")]["cells"] == [f"{MODEL}/{KERNELS} B=64 x 131072"]
    assert "Not counted:" in out["sentences"][-1]


def test_no_rows_is_not_measured_and_claims_carry_the_entry():
    empty = results_of(pd.DataFrame())
    out = targets.e2e_verdicts(empty)
    assert not out["measured"] and out["cells"] == [] and out["step"] == {} and out["gain"] == {}
    assert out["sentences"] == ["Not measured: no full decode step rows (e2e/pass*.parquet) on test-gpu yet."]
    refused_only = verdicts([{**r, "status": "refused", "reason": "too big"}
                             for r in cell_rows({"pkv-workqueue": (1.0, 1.0)}, rounds=1)])
    assert not refused_only["measured"] and refused_only["not_run"][0]["reason"] == "too big"
    # ours without any baseline: a cell without a pair, judged nowhere
    alone = verdicts(cell_rows({"pkv-workqueue": (1000.0, 200.0)}))
    assert alone["measured"] and alone["cells"] == [] and len(alone["without_pair"]) == 1
    assert "not measured" in alone["sentences"][0]
    assert claims.judge(empty)["e2e"]["measured"] is False


def test_a_partial_run_says_so():
    rows = cell_rows({"pkv-workqueue": (1000.0, 200.0), "flashinfer-tc": (1010.0, 210.0)})
    partial = verdicts(rows, provenance={"run": {"complete": False, "configurations": {"done": 1, "total": 5}}})
    assert partial["complete"] is False and partial["sentences"][0].startswith("Partial:")
    whole = verdicts(rows, provenance={"run": {"complete": True}})
    assert whole["complete"] is True and not whole["sentences"][0].startswith("Partial:")


def test_a_partial_run_says_how_far_it_got_and_what_stopped_it():
    from persistentkv.targets import _first, _stopped_phrase

    said = _stopped_phrase({"done": 18, "total": 19, "stopped_by": "RuntimeError: an illegal memory access"})
    assert said == "the run finished 18 of 19 configurations (stopped by: RuntimeError: an illegal memory access)"
    assert _stopped_phrase({}) == "the run stopped before its end"
    labels = [f"cell {i}" for i in range(8)]
    assert _first(labels) == "cell 0, cell 1, cell 2, cell 3, cell 4 and 3 more"
    assert _first(labels[:2]) == "cell 0, cell 1"


def test_attention_in_the_step_beyond_attention_alone_is_reported_per_backend():
    """step - rest - attention per cell (median over rounds), then median / lowest / highest over
    cells; rows without rest_us (runs before it was measured) give nothing and no sentence."""
    rows = []
    for context, extra in ((4096, 150.0), (32768, 90.0), (131072, 250.0)):
        part = cell_rows({"pkv-workqueue": (1000.0, 200.0), "flashinfer-tc": (1100.0, 300.0)}, context=context)
        for row in part:   # the step without attention: ours hides `extra` us, the baseline's none
            row["rest_us"] = row["step_us"] - row["attention_us"] - (extra if row["backend"] == "pkv-workqueue" else 0)
        rows += part
    got = {r["backend"]: r for r in verdicts(rows)["in_step"]}
    assert got["pkv-workqueue"]["cells"] == 3
    assert got["pkv-workqueue"]["median_us"] == pytest.approx(150.0)
    assert (got["pkv-workqueue"]["min_us"], got["pkv-workqueue"]["max_us"]) == (pytest.approx(90.0), pytest.approx(250.0))
    assert got["flashinfer-tc"]["median_us"] == pytest.approx(0.0, abs=1e-9)
    said = " ".join(verdicts(rows)["sentences"])
    assert "pkv-workqueue 150 us [90, 250]; flashinfer-tc 0 us [0, 0]" in said
    without = verdicts(cell_rows({"pkv-workqueue": (1000.0, 200.0), "flashinfer-tc": (1100.0, 300.0)}))
    assert without["in_step"] == [] and "beyond attention alone" not in " ".join(without["sentences"])


def test_the_rest_is_judged_against_the_measured_one_kernel_floors_where_the_rows_have_them():
    """Rows without weight_kernel_floor_us (runs before it) are judged at the read ceiling; rows with
    it are judged against it, and the ceiling's fraction is still said."""
    rows = cell_rows({"pkv-workqueue": (1000.0, 200.0), "flashinfer-tc": (1100.0, 300.0)}, batch_size=1,
                     weight_floor_us=600.0)
    (plain,) = verdicts(rows)["rest"]
    assert "kernel_frac" not in plain and plain["yardstick"] == "read ceiling"
    assert plain["frac"] == pytest.approx(600.0 / 800.0) and not plain["holds"]   # 0.75 < 0.80
    assert "no one-kernel floors in these rows): does not hold" in " ".join(verdicts(rows)["sentences"])
    for row in rows:
        row["weight_kernel_floor_us"] = 720.0
    (rest,) = verdicts(rows)["rest"]
    assert rest["frac"] == pytest.approx(600.0 / 800.0)          # median rest: 800 (ours) and 800 (theirs)
    assert rest["kernel_frac"] == pytest.approx(720.0 / 800.0) and rest["kernel_lo"] <= rest["kernel_frac"]
    assert rest["yardstick"] == "one-kernel floor" and rest["holds"]             # 0.90 >= 0.80
    said = " ".join(verdicts(rows)["sentences"])
    assert "one plain kernel, measured in the same run (target 0.8): holds; 0.750" in said
    for row in rows:
        row["weight_kernel_floor_us"] = 560.0
    (short,) = verdicts(rows)["rest"]
    assert short["kernel_frac"] == pytest.approx(0.70) and not short["holds"] and not short["interval_clears"]
