"""The FP8 cache beyond the kernel grids: the full step, validate-gpu and the logits over an FP8
cache, as the ``fp8`` entry of claims.json judges and reports them (targets_fp8), the loader that
reads their files, and the Snakemake rules that make them.

Constructed rows: a full step where ours reaches the fastest FP8 baseline in every cell and where it
does not; validate-gpu rows where every gated backend passes, where one misses, and where only an
FP8-query backend misses (reported, not failed); fp8-logits rows summarised per model and scales.
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest
from test_e2e_verdicts import cell_rows
from workflow_support import ROOT, job_counts, needs_snakemake, snakemake

import synthetic
from persistentkv import configuration, io, targets, targets_fp8
from persistentkv.results import Results, load_results

FP8 = "float8_e4m3"


def empty_results(**fields) -> Results:
    empty = pd.DataFrame()
    return Results(hw="test-gpu", raw=empty, bench=empty, validation_gpu=empty, validation_cpu=empty,
                   ablation_buckets=empty, ablation_splits=empty, provenance={"run": {}}, policy=None, kernels=None,
                   config=synthetic.config(), **fields)


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


def passing_runs() -> dict:
    """Results fields for a full step over an FP8 cache and validate-gpu rows that pass every rule."""
    return {"e2e_fp8": e2e_rows(990.0), "validation_gpu_fp8": validation_rows(
        {"pkv-workqueue": 3e-4, "flashinfer-tc": 5e-4, "trtllm-xqa": 4e-2})}


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
    assert not {"validate_gpu_fp8", "fp8_logits", "measure_e2e_fp8_pass"} & set(job_counts(none.stdout))


def test_the_report_shows_the_runs_over_an_fp8_cache():
    from test_fp8_pipeline import fp8_results

    from persistentkv.render import report

    logits = pd.DataFrame({"model": "llama3_8b", "scales": "per-tensor", "backend": "pkv-workqueue",
                           "dtype": "float16", "step": [0, 1], "row": [0, 0], "context": [2049, 2050],
                           "rel_err": [0.012, 0.031], "top1": [True, False]})
    results = replace(fp8_results(), **passing_runs(), fp8_logits=logits,
                      e2e=e2e_rows(1700.0, best=1800.0, kv_dtype="float16"))
    context = report.fp8_context(targets_fp8.fp8_verdicts(results), results)
    page = report.environment().get_template("fp8.html.j2").render(**context, hw="test-gpu", ratio_ci=report.ratio_ci)
    validation = page[page.index('id="fp8-validation"'):page.index('id="fp8-e2e"')]
    assert "<td>pkv-workqueue</td><td class=\"num\">2 / 2</td>" in validation
    assert "rounded to e4m3: reported, not gated" in validation and "4.0e-02" in validation
    e2e = page[page.index('id="fp8-e2e"'):page.index('id="fp8-logits"')]
    assert e2e.count("<tr><td>") == 2 and "%.3f×" % (1700 / 990) in e2e
    logit_table = page[page.index('id="fp8-logits"'):]
    assert "<td>llama3_8b</td><td>per-tensor</td>" in logit_table and "3.10e-02" in logit_table
    assert "0.500" in logit_table
