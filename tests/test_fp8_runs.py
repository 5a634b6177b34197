"""The FP8 cache beyond the kernel grids: the full step, validate-gpu and the logits over an FP8
cache, as the ``fp8`` entry of claims.json judges and reports them (targets_fp8), the loader that
reads their files, and the Snakemake rules that make them.

Constructed rows: a full step where ours reaches the fastest FP8 baseline in every cell and where it
does not; validate-gpu rows where every gated backend passes, where one misses, and where only an
FP8-query backend misses (reported, not failed); fp8-logits rows summarised per model and scales;
the FP8 policy's holdout rows (raw_fp8/), judged as the fp16 policy's, where it holds and where a
planted slowdown of the adaptive rows makes it miss.
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest
from test_e2e_verdicts import cell_rows
from workflow_support import ROOT, job_counts, needs_snakemake, snakemake

import synthetic
from persistentkv import claims, cli, configuration, io, targets, targets_fp8
from persistentkv.results import Results, load_results, sidecar_paths

FP8 = "float8_e4m3"


def empty_results(**fields) -> Results:
    empty = pd.DataFrame()
    return Results(**{"hw": "test-gpu", "raw": empty, "bench": empty, "validation_gpu": empty,
                      "validation_cpu": empty, "ablation_buckets": empty, "ablation_splits": empty,
                      "provenance": {"run": {}}, "policy": None, "kernels": None, "config": synthetic.config(),
                      **fields})


def e2e_rows(ours: float, best: float = 1000.0, batch_sizes=(1, 4), kv_dtype: str = FP8) -> pd.DataFrame:
    rows = []
    for b in batch_sizes:
        rows += cell_rows({"pkv-workqueue": (ours, 150.0), "flashinfer-tc": (best, 300.0),
                           "trtllm-xqa": (best * 1.2, 400.0)}, batch_size=b)
    return pd.DataFrame(rows).assign(kv_dtype=kv_dtype, dtype="float16")


def validation_rows(errors: dict, rtol: float = 2e-3, fp8_query=("trtllm-xqa",)) -> pd.DataFrame:
    """backend -> its worst (row, head) error at each of two steps."""
    rows = []
    for backend, err in errors.items():
        for step in (3, 9):
            rows.append({"trace": "bimodal_b8", "seed": 1, "step": step, "backend": backend, "dtype": "float16",
                         "kv_dtype": FP8, "fp8_query": backend in fp8_query, "max_row_head_err": err * step / 9,
                         "rtol": rtol, "passed": err * step / 9 <= rtol, "status": "ok", "reason": ""})
    rows.append({"trace": "bimodal_b8", "seed": 1, "step": 3, "backend": "vllm-fa3", "dtype": "float16",
                 "kv_dtype": FP8, "fp8_query": False, "max_row_head_err": float("nan"), "rtol": rtol, "passed": False,
                 "status": "unavailable", "reason": "writes bfloat16 only"})
    return pd.DataFrame(rows)


def policy_rows(adaptive_scale: float = 1.0) -> pd.DataFrame:
    """The FP8 policy's holdout rows (results/<hw>/raw_fp8/published.parquet): synthetic published
    rows on an FP8 cache where FlashInfer takes twice its time and the adaptive backend, in every
    round, the fastest single backend's time x ``adaptive_scale`` (1: a policy that always picks
    the best, which passes both rules)."""
    rows = synthetic.raw_frames()["published"].assign(kv_dtype=FP8)
    ok = rows["status"] == "ok"
    flashinfer = rows["backend"].str.startswith("flashinfer")
    rows.loc[flashinfer, ["time_us", "per_layer_us"]] *= 2.0
    key = ["trace", "seed", "step", "protocol", "repeat"]
    single = rows[ok & (rows["backend"] != "adaptive")]
    best = single.groupby(key)[["time_us", "per_layer_us"]].min() * adaptive_scale
    adaptive = rows[ok & (rows["backend"] == "adaptive")]
    rows.loc[adaptive.index, ["time_us", "per_layer_us"]] = best.loc[
        pd.MultiIndex.from_frame(adaptive[key])].to_numpy()
    return rows


def passing_runs() -> dict:
    """Results fields for a full step over an FP8 cache, validate-gpu rows and the FP8 policy's
    holdout rows that pass every rule."""
    return {"e2e_fp8": e2e_rows(990.0), "validation_gpu_fp8": validation_rows(
        {"pkv-workqueue": 3e-4, "flashinfer-tc": 5e-4, "trtllm-xqa": 4e-2}), "raw_fp8": policy_rows()}


def test_the_fp8_policy_is_judged_on_its_own_rows_as_the_fp16_policy_is():
    """claims.fp8_adaptive runs claims.adaptive_verdicts on results.raw_fp8 alone (the fp16 rows of
    results.raw never enter it); targets_fp8.fp8_policy holds when the step rows' minimum and
    geometric mean both hold, fails on a planted 10 % slowdown of the adaptive rows, and is not
    measured without rows; its thresholds are the fp16 policy's."""
    assert (targets_fp8.FP8_POLICY_MIN_RATIO, targets_fp8.FP8_POLICY_GEOMEAN) == \
        (claims.ADAPTIVE_MIN_RATIO, claims.ADAPTIVE_GEOMEAN)
    assert claims.fp8_adaptive(empty_results()) is None
    assert targets_fp8.fp8_policy(None, None)["verdict"] == targets.NOT_MEASURED
    fp16 = synthetic.raw_frames()["published"]
    results = empty_results(raw=fp16.assign(time_us=fp16["time_us"] * 50), raw_fp8=policy_rows())
    adaptive = claims.fp8_adaptive(results)
    assert adaptive == claims.adaptive_verdicts(empty_results(raw=policy_rows()))
    entry = targets_fp8.fp8_policy(adaptive, {"run_id": "calibration-fp8"})
    step = adaptive["protocols"]["step"]
    assert step["cells"] > 0 and step["holds_floor"] and step["holds_geomean"]
    assert entry["verdict"] == targets.HOLDS and entry["fitted_on"] == "calibration-fp8"
    assert entry["cells"] == step["cells"] and entry["geomean"] == step["geomean"]
    slow = targets_fp8.fp8_policy(claims.fp8_adaptive(empty_results(raw_fp8=policy_rows(1.1))), None)
    assert slow["verdict"] == targets.FAILS and slow["below"] and slow["fitted_on"] is None
    out = targets_fp8.fp8_verdicts(empty_results(raw_fp8=policy_rows(1.1)), claims.fp8_adaptive(
        empty_results(raw_fp8=policy_rows(1.1))))
    assert out["policy"]["verdict"] == targets.FAILS and out["verdict"] == targets.FAILS and out["measured"]
    assert any(s.startswith("The FP8 policy on the FP8 holdout rows: Step rows") for s in out["sentences"])


def test_the_full_step_over_an_fp8_cache_is_judged_cell_by_cell_and_its_gain_over_fp16_reported():
    fp16 = e2e_rows(1700.0, best=1800.0, kv_dtype="float16")
    out = targets_fp8.fp8_e2e(empty_results(e2e=fp16, e2e_fp8=e2e_rows(995.0)))
    assert out["verdict"] == targets.HOLDS and out["measured"] and len(out["cells"]) == 2
    assert all(c["baseline"] == "flashinfer-tc" and c["ratio"] == pytest.approx(1000 / 995) for c in out["cells"])
    assert [g["gain"] for g in out["gain"]] == [pytest.approx(1700 / 995)] * 2
    slow = targets_fp8.fp8_e2e(empty_results(e2e_fp8=e2e_rows(1000.0, batch_sizes=(1,)) .pipe(
        lambda f: pd.concat([f, e2e_rows(1030.0, batch_sizes=(4,))]))))
    assert slow["verdict"] == targets.FAILS and len(slow["below"]) == 1 and "B=4" in slow["below"][0]
    assert slow["gain"] == []  # no fp16 run to set it against
    assert targets_fp8.fp8_e2e(empty_results())["verdict"] == targets.NOT_MEASURED


def test_validation_gates_every_backend_but_reports_an_fp8_query():
    ok = targets_fp8.fp8_validation(empty_results(validation_gpu_fp8=passing_runs()["validation_gpu_fp8"]))
    assert ok["verdict"] == targets.HOLDS and ok["unavailable"] == ["vllm-fa3"]
    by = {b["backend"]: b for b in ok["backends"]}
    assert by["trtllm-xqa"]["fp8_query"] and by["trtllm-xqa"]["passed"] < by["trtllm-xqa"]["rows"]
    assert by["pkv-workqueue"]["passed"] == 2 and by["pkv-workqueue"]["max_err"] == pytest.approx(3e-4)
    missed = validation_rows({"pkv-workqueue": 3e-3, "flashinfer-tc": 5e-4, "trtllm-xqa": 4e-2})
    bad = targets_fp8.fp8_validation(empty_results(validation_gpu_fp8=missed))
    assert bad["verdict"] == targets.FAILS
    assert targets_fp8.fp8_validation(empty_results())["verdict"] == targets.NOT_MEASURED


def test_the_logits_are_summarised_per_model_and_scales():
    rows = pd.DataFrame({"model": "m", "scales": ["per-tensor"] * 4 + ["per-head"] * 4, "backend": "pkv-workqueue",
                         "dtype": "float16", "step": [0, 0, 1, 1] * 2, "row": [0, 1] * 4, "context": [10, 5, 11, 6] * 2,
                         "rel_err": [0.01, 0.02, 0.03, 0.04, 0.01, 0.01, 0.01, 0.05], "top1": [True] * 7 + [False]})
    out = targets_fp8.fp8_logits(empty_results(fp8_logits=rows))
    by = {c["scales"]: c for c in out["cases"]}
    assert by["per-tensor"]["max_rel_err"] == 0.04 and by["per-tensor"]["median_rel_err"] == pytest.approx(0.025)
    assert by["per-head"]["top1"] == 0.75 and by["per-head"]["steps"] == 2 and by["per-head"]["max_context"] == 11
    assert targets_fp8.fp8_logits(empty_results()) == {"measured": False, "cases": []}


def test_the_entry_says_each_part_and_holds_only_when_every_part_does():
    from test_fp8_pipeline import fp8_results

    grids = fp8_results()
    for planted, part in ((dict(passing_runs(), e2e_fp8=e2e_rows(1030.0)), "e2e"),
                          (dict(passing_runs(), validation_gpu_fp8=validation_rows({"pkv-workqueue": 1e-2})),
                           "validation")):
        out = targets_fp8.fp8_verdicts(replace(grids, **planted))
        assert out["verdict"] == targets.FAILS and out[part]["verdict"] == targets.FAILS, part
    out = targets_fp8.fp8_verdicts(replace(grids, **passing_runs()))
    text = " ".join(out["sentences"])
    assert "The full decode step over an FP8 cache" in text and "validate-gpu over an FP8 cache" in text
    assert "trtllm-xqa 4.0e-02 (tolerance 0.002)" in text
    nothing = targets_fp8.fp8_verdicts(empty_results())
    assert nothing["measured"] is False and targets_fp8.FP8_RUNS_COMMAND in nothing["sentences"][0]


def test_the_loader_reads_the_fp8_runs_and_keeps_them_apart(tmp_path):
    hw = tmp_path / "gpu-x"
    (hw / "e2e_fp8").mkdir(parents=True)
    io.atomic_write_parquet(hw / "e2e_fp8" / "pass1.parquet", e2e_rows(990.0))
    io.atomic_write_parquet(hw / "validation_gpu_fp8.parquet", passing_runs()["validation_gpu_fp8"])
    io.atomic_write_parquet(hw / "fp8_logits.parquet", pd.DataFrame({"model": ["m"], "rel_err": [0.01]}))
    results = load_results(hw, counters_dir=tmp_path / "counters")
    assert results.e2e.empty and results.validation_gpu.empty       # the fp16 files stay the fp16 files
    assert len(results.e2e_fp8) == len(e2e_rows(990.0)) and set(results.e2e_fp8["kv_dtype"]) == {FP8}
    assert results.validation_gpu_fp8["fp8_query"].any() and len(results.fp8_logits) == 1
    assert {"e2e_fp8/pass1", "validation_gpu_fp8", "fp8_logits"} <= set(results.found)
    assert not {"e2e_fp8", "validation_gpu_fp8", "fp8_logits"} & set(results.missing)
    assert results.raw_fp8.empty and results.policy_fp8 is None and "policy_fp8" not in results.missing


def test_the_loader_keeps_the_fp8_policys_rows_and_fit_apart_from_the_fp16_ones(tmp_path):
    """raw_fp8/*.parquet (measure --kv-dtype float8_e4m3) load into results.raw_fp8, never into raw or
    timing; policy_fp8.json into results.policy_fp8; their sidecars are among the provenance's."""
    hw = tmp_path / "gpu-x"
    (hw / "raw").mkdir(parents=True)
    (hw / "raw_fp8").mkdir()
    fp16 = synthetic.raw_frames()["published"]
    io.atomic_write_parquet(hw / "raw" / "published.parquet", fp16)
    io.atomic_write_parquet(hw / "raw_fp8" / "published.parquet", policy_rows())
    (hw / "raw_fp8" / "published.json").write_text('{"published-fp8": {"gpu": "x"}}')
    (hw / "policy_fp8.json").write_text('{"run_id": "calibration-fp8"}')
    results = load_results(hw, counters_dir=tmp_path / "counters")
    assert len(results.raw) == len(fp16) and len(results.raw_fp8) == len(policy_rows())
    assert len(results.timing) == len(fp16) and set(results.raw_fp8["kv_dtype"]) == {FP8}
    assert results.policy_fp8 == {"run_id": "calibration-fp8"} and "raw_fp8/published" in results.found
    assert hw / "raw_fp8" / "published.json" in sidecar_paths(hw) and "published-fp8" in results.provenance


@needs_snakemake
def test_the_fp8_runs_are_gpu_jobs_of_all_with_their_commands(tmp_path):
    from test_fp8_pipeline import _env, _with_target

    copy = _with_target(tmp_path)
    done = snakemake(copy, "-n", "-p", "all", env=_env(tmp_path))
    assert done.returncode == 0, done.stderr + done.stdout
    counts = job_counts(done.stdout)
    passes = configuration.load_config(ROOT / "config" / "config.yaml")["measure"]["e2e_passes"]
    assert counts["validate_gpu_fp8"] == counts["fp8_logits"] == 1 and counts["measure_e2e_fp8_pass"] == passes
    text = done.stdout
    assert ("persistentkv validate-gpu --config config/config.yaml --traces-dir build/traces --kv-dtype float8_e4m3"
            " --out results/nvidia-h200/validation_gpu_fp8.parquet") in text
    assert ("persistentkv measure-e2e --config config/config.yaml --kv-dtype float8_e4m3 --out "
            "results/nvidia-h200/e2e_fp8/pass1.parquet") in text
    assert "persistentkv fp8-logits --config config/config.yaml --device cuda --out results/nvidia-h200/fp8_logits" in text
    none = snakemake(_with_target(tmp_path / "none", kv_dtypes=[]), "-n", "all", env=_env(tmp_path))
    assert none.returncode == 0, none.stderr
    assert not {"validate_gpu_fp8", "fp8_logits", "measure_e2e_fp8_pass", "measure_fp8", "calibrate_fp8"} \
        & set(job_counts(none.stdout))


def test_measure_takes_an_fp8_cache_for_the_policys_experiments_only(capsys):
    """persistentkv measure --kv-dtype float8_e4m3: the FP8 policy's experiments (names.FP8_EXPERIMENTS)
    on FP8 caches; another experiment is one line before any GPU check; the cases carry the FP8 spec."""
    from persistentkv.measure.workload import experiment_cases
    from persistentkv.names import FP8_EXPERIMENTS

    assert FP8_EXPERIMENTS == ("calibration", "published", "long_context")
    code = cli.main(["measure", "--config", "config/config.yaml", "--experiment", "gqa_sweep", "--kv-dtype", FP8,
                     "--out", "x.parquet"])
    err = capsys.readouterr().err
    assert code == 2 and "--kv-dtype float8_e4m3 measures the experiments calibration, published, long_context" \
        in err and "not gqa_sweep" in err
    config = configuration.load_config(ROOT / "config" / "config.yaml")
    cases = experiment_cases("long_context", config, None, kv_dtype=FP8)
    assert cases and {c.spec.kv_dtype for c in cases} == {FP8}
    assert {c.spec.kv_dtype for c in experiment_cases("long_context", config, None)} == {None}


def test_the_report_shows_the_runs_over_an_fp8_cache():
    from test_fp8_pipeline import fp8_results

    from persistentkv.render import report

    logits = pd.DataFrame({"model": "llama3_8b", "scales": "per-tensor", "backend": "pkv-workqueue",
                           "dtype": "float16", "step": [0, 1], "row": [0, 0], "context": [2049, 2050],
                           "rel_err": [0.012, 0.031], "top1": [True, False]})
    results = replace(fp8_results(), **passing_runs(), fp8_logits=logits,
                      e2e=e2e_rows(1700.0, best=1800.0, kv_dtype="float16"))
    context = report.fp8_context(targets_fp8.fp8_verdicts(results), results, "data:image/svg+xml;base64,AA==")
    page = report.environment().get_template("fp8.html.j2").render(**context, hw="test-gpu", ratio_ci=report.ratio_ci)
    validation = page[page.index('id="fp8-validation"'):page.index('id="fp8-e2e"')]
    assert "<td>pkv-workqueue</td><td class=\"num\">2 / 2</td>" in validation
    assert "rounded to e4m3: reported, not gated" in validation and "4.0e-02" in validation
    e2e = page[page.index('id="fp8-e2e"'):page.index('id="fp8-logits"')]
    assert e2e.count("<tr><td>") == 2 and "%.3f×" % (1700 / 990) in e2e
    heading = page[page.index("The full decode step over an FP8 cache"):page.index('id="fp8-e2e"')]
    assert 'href="#fig-e2e"' in heading  # the table points at its figure (the FP8 panels of fig-e2e)
    logit_table = page[page.index('id="fp8-logits"'):]
    assert "<td>llama3_8b</td><td>per-tensor</td>" in logit_table and "3.10e-02" in logit_table
    assert "0.500" in logit_table
