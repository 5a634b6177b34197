"""The FP8 KV cache as a pipeline axis: bench-kernels / bench-shapes --kv-dtype, the kv_dtype column
and the loader's fill for files without it, targets_fp8.fp8_verdicts on constructed rows (every rule
holding, each rule missed once, nothing measured), and the Snakemake targets of config
measure.kv_dtypes."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import yaml
from workflow_support import (ROOT, copy_workflow, fake_calls, fake_gpu_env, gpu_env, job_counts, needs_snakemake,
                              snakemake)

import synthetic
from persistentkv import claims, cli, configuration, targets, targets_fp8
from persistentkv.commands import bench_kernels, bench_shapes
from persistentkv.commands.measure import parse_kv_dtype
from persistentkv.errors import PKVError
from persistentkv.measure import runner
from persistentkv.measure.rows import RAW_COLUMNS, raw_frame, raw_row
from persistentkv.measure.workload import shapes_cases
from persistentkv.names import FLOOR_BACKEND, FP8_KV, SHAPES_EXPERIMENT, kv_grid_name
from persistentkv.results import Results, load_results
from persistentkv.spec import AttentionSpec

CONFIG = configuration.load_config(ROOT / "config" / "config.yaml", base_dir=ROOT)
OURS = targets.ENGINE_BACKEND
MiB = 2**20


# -- the command line -----------------------------------------------------------------------------
@pytest.mark.parametrize("module", [bench_kernels, bench_shapes])
def test_the_grids_take_kv_dtype(module):
    import argparse

    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args(["--config", "c.yaml", "--out", "o.parquet"])
    assert args.kv_dtype == "auto" and parse_kv_dtype(args.kv_dtype) is None
    args = parser.parse_args(["--config", "c.yaml", "--out", "o.parquet", "--kv-dtype", "float8_e4m3"])
    assert parse_kv_dtype(args.kv_dtype) == FP8_KV


@pytest.mark.parametrize("command", ["bench-kernels", "bench-shapes"])
@pytest.mark.parametrize("bad", ["float8_e5m2", "fp8", "float16", ""])
def test_a_bad_kv_dtype_is_one_line_before_any_gpu_is_looked_for(command, bad, capsys, tmp_path):
    code = cli.main([command, "--config", str(ROOT / "config" / "config.yaml"), "--out",
                     str(tmp_path / "x.parquet"), "--kv-dtype", bad])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == f"error: --kv-dtype {bad!r} is not one of auto, float8_e4m3"
    assert not (tmp_path / "x.parquet").exists()


def test_the_bench_grid_on_fp8_caches_reads_half_the_bytes():
    fp16 = runner.bench_cases(CONFIG, None, ["pkv-workqueue", "flashinfer-tc"], quick=True)
    fp8 = runner.bench_cases(CONFIG, None, ["pkv-workqueue", "flashinfer-tc"], quick=True, kv_dtype=FP8_KV)
    assert [c.trace for c in fp8] == [c.trace for c in fp16] and fp8
    for a, b in zip(fp16, fp8):
        assert a.spec.cache_dtype == "float16" and b.spec.cache_dtype == FP8_KV and b.spec.dtype == "float16"
        assert b.batch.kv_bytes * 2 == a.batch.kv_bytes
        assert list(b.batch.seq_lens) == list(a.batch.seq_lens)


def test_the_one_kernel_floor_reads_the_fp8_bytes_and_the_rows_say_so():
    from test_floor import FakeFloorDevice, FakeReader, cost_by_grid

    from persistentkv.measure.harness import Settings, one_kernel_floor
    from persistentkv.measure.rows import case_fields

    (fp16,) = [c for c in runner.bench_cases(CONFIG, None, ["pkv-workqueue"], quick=True) if c.trace == "B1xN131072"]
    (fp8,) = [c for c in runner.bench_cases(CONFIG, None, ["pkv-workqueue"], quick=True, kv_dtype=FP8_KV)
              if c.trace == "B1xN131072"]
    settings = Settings(protocols=("kernel",))
    floors = {c.spec.cache_dtype: one_kernel_floor(c, FakeFloorDevice(cost_by_grid), settings, reader=FakeReader)
              for c in (fp16, fp8)}
    assert floors[FP8_KV].nbytes == fp8.batch.kv_bytes == 131072 * 2 * 8 * 128 * 1      # 268 MB of codes
    assert floors["float16"].nbytes == 2 * floors[FP8_KV].nbytes
    fields = case_fields(fp8)
    assert (fields["dtype"], fields["kv_dtype"], fields["kv_bytes"]) == ("float16", FP8_KV, fp8.batch.kv_bytes)


def test_the_shapes_grid_on_fp8_caches_keeps_its_cells():
    fp16, skipped16 = shapes_cases(CONFIG, ["pkv-workqueue"], quick=True)
    fp8, skipped8 = shapes_cases(CONFIG, ["pkv-workqueue"], quick=True, kv_dtype=FP8_KV)
    assert skipped8 == skipped16
    assert [(c.trace, c.spec.num_kv_heads, c.spec.num_qo_heads) for c in fp8] == \
        [(c.trace, c.spec.num_kv_heads, c.spec.num_qo_heads) for c in fp16]
    assert all(b.batch.kv_bytes * 2 == a.batch.kv_bytes and b.spec.fp8_kv for a, b in zip(fp16, fp8))


def test_rows_name_the_cache_dtype():
    base = dict(run_id="r", experiment="bench_kernels", trace="t", seed=0, step=0, batch_size=1, max_len=1,
                total_tokens=1, kv_bytes=1, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                dtype="float16", hole_fraction=0.0, backend="x", route="x", protocol="kernel", repeat=0)
    assert raw_row(**base)["kv_dtype"] == "float16"
    assert raw_row(**base, kv_dtype=FP8_KV)["kv_dtype"] == FP8_KV
    assert list(RAW_COLUMNS).index("kv_dtype") == list(RAW_COLUMNS).index("dtype") + 1


# -- the loader -----------------------------------------------------------------------------------
def test_the_loader_fills_kv_dtype_for_files_without_it(tmp_path):
    hw = tmp_path / "test-gpu"
    hw.mkdir()
    old = synthetic.bench_frame()
    assert "kv_dtype" not in old.columns
    old.to_parquet(hw / "bench_kernels.parquet", index=False)
    fp8 = case_rows(FP8_KV, "bench_kernels", "B1xN4096", 1, 8, 4, 4096, {OURS: 10.0})
    raw_frame(fp8).to_parquet(hw / f"{kv_grid_name('bench_kernels', FP8_KV)}.parquet", index=False)
    loaded = load_results(hw, tmp_path / "none", synthetic.config())
    bench = loaded.bench
    assert list(bench.columns).index("kv_dtype") == list(bench.columns).index("dtype") + 1
    pd.testing.assert_series_equal(bench["kv_dtype"], old["dtype"], check_names=False)
    assert bench.drop(columns="kv_dtype").equals(old)          # nothing else changed
    grid = loaded.kv_grid("bench_kernels", FP8_KV)
    assert set(grid["kv_dtype"]) == {FP8_KV} and len(grid) == len(fp8)
    assert FP8_KV not in set(loaded.timing["kv_dtype"])           # never pooled with the fp16 cells
    assert not any("fp8" in m for m in loaded.missing)          # an absent FP8 file is no 'missing' line


def test_the_committed_files_read_as_caches_of_their_query_dtype_or_of_fp8():
    """The fp16 grids and experiments (written before kv_dtype existed) read as caches of their
    query's dtype; the committed FP8 grids as e4m3 caches at an fp16 query, each case's attention
    bytes half those of its fp16 twin (the same trace and heads) in bench_kernels / bench_shapes."""
    loaded = load_results(ROOT / "results" / "nvidia-h200", ROOT / "results" / "counters", CONFIG)
    for frame in (loaded.bench, loaded.shapes, loaded.raw):
        assert not frame.empty and (frame["kv_dtype"] == frame["dtype"]).all()
    assert set(loaded.kv_grids) == {kv_grid_name(grid, FP8_KV) for grid in ("bench_kernels", SHAPES_EXPERIMENT)}
    key = ["trace", "num_qo_heads", "num_kv_heads"]
    for grid, twin in (("bench_kernels", loaded.bench), (SHAPES_EXPERIMENT, loaded.shapes)):
        fp8 = loaded.kv_grid(grid, FP8_KV)
        attention = fp8[(fp8["protocol"] == "kernel") & (fp8["backend"] == "pkv-workqueue")]
        assert not attention.empty and set(attention["kv_dtype"]) == {FP8_KV}
        assert set(attention["dtype"]) == {"float16"}
        fp16 = twin[(twin["protocol"] == "kernel") & (twin["backend"] == "pkv-workqueue")]
        halves = attention.groupby(key)["kv_bytes"].first() * 2
        assert (halves == fp16.groupby(key)["kv_bytes"].first().reindex(halves.index)).all(), grid


# -- the verdicts ---------------------------------------------------------------------------------
def case_rows(kv_dtype, grid, trace, batch, hkv, g, tokens, times, repeats=7, kv_bytes=None):
    """Kernel rows of one case: ``batch`` rows of ``tokens`` at Hkv, G (D=128) on a ``kv_dtype``
    cache (kv_bytes its bytes unless given), ``times``: backend -> median us (1 % noise)."""
    itemsize = 1 if kv_dtype == FP8_KV else 2
    nbytes = kv_bytes if kv_bytes is not None else batch * tokens * 2 * hkv * 128 * itemsize
    rng = np.random.default_rng([batch, hkv, g, tokens, itemsize])
    out = []
    for backend, t in times.items():
        for r in range(repeats):
            out.append(raw_row(run_id=f"run-{kv_dtype}", experiment=grid, trace=trace, seed=0, step=0,
                               batch_size=batch, max_len=tokens, total_tokens=batch * tokens, kv_bytes=int(nbytes),
                               num_qo_heads=g * hkv, num_kv_heads=hkv, head_dim=128, page_size=16, dtype="float16",
                               kv_dtype=kv_dtype, hole_fraction=0.0, backend=backend, route=backend,
                               protocol="kernel", repeat=r, time_us=t * float(np.exp(rng.normal(0, 0.01))),
                               per_layer_us=t, status="ok"))
    return out


#: (grid, trace, B, Hkv, G, tokens per row, speedup over the fastest baseline) of the constructed
#: FP8 grids: the four named cells at 0.15 above their targets, the rest at 1.25.
CASES = [("bench_kernels", "B1xN131072", 1, 8, 4, 131072, 1.50),
         ("bench_kernels", "B8-bimodal", 8, 8, 4, 16256, 1.50),
         ("bench_kernels", "B64xN8192", 64, 8, 4, 8192, 1.30),
         ("bench_kernels", "B4xN4096", 4, 8, 4, 4096, 1.25),
         ("bench_kernels", "B1xN147456", 1, 8, 4, 147456, 1.25),    # 302 MB of FP8, 604 MB of fp16
         (SHAPES_EXPERIMENT, "B1xN32768", 1, 1, 4, 32768, 1.65),
         (SHAPES_EXPERIMENT, "B4xN16384", 4, 2, 8, 16384, 1.25)]


def fp8_results(speedup=None, floor_frac=None, fp16_ratio=None, grids=("bench_kernels", SHAPES_EXPERIMENT)) -> Results:
    """Both FP8 grids and the fp16 bench grid, built to pass every rule; ``speedup``, ``floor_frac``,
    ``fp16_ratio``: {trace: value} planted misses."""
    speedup, floor_frac, fp16_ratio = speedup or {}, floor_frac or {}, fp16_ratio or {}
    fp8 = {grid: [] for grid in grids}
    fp16 = []
    for grid, trace, b, hkv, g, n, ratio in CASES:
        if grid not in grids:
            continue
        ours = 3.0 + b * n * 2 * hkv * 128 / 4.0e6       # us: 4 TB/s on the FP8 bytes
        times = {OURS: ours, "flashinfer-tc": ours * speedup.get(trace, ratio),
                 "trtllm-xqa": ours * speedup.get(trace, ratio) * 1.2,
                 FLOOR_BACKEND: ours * floor_frac.get(trace, 0.95)}
        fp8[grid] += case_rows(FP8_KV, grid, trace, b, hkv, g, n, times)
        if grid == "bench_kernels":
            fp16 += case_rows("float16", grid, trace, b, hkv, g, n,
                              {OURS: ours * fp16_ratio.get(trace, 1.95), "flashinfer-tc": ours * 2.2,
                               FLOOR_BACKEND: ours * 1.9})
    unavailable = raw_row(run_id="run-fp8", experiment="bench_kernels", trace="B1xN131072", seed=0, step=0,
                          batch_size=1, max_len=131072, total_tokens=131072, kv_bytes=131072 * 2048,
                          num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="float16",
                          kv_dtype=FP8_KV, hole_fraction=0.0, backend="vllm-fa3", route="vllm-fa3",
                          status="unavailable", reason="vLLM FA3 with an FP8 cache writes bfloat16 only")
    if "bench_kernels" in fp8:
        fp8["bench_kernels"].append(unavailable)
    empty = pd.DataFrame()
    return Results(hw="test-gpu", raw=empty, bench=raw_frame(fp16) if fp16 else empty, validation_gpu=empty,
                   validation_cpu=empty, ablation_buckets=empty, ablation_splits=empty, provenance={}, policy=None,
                   kernels=None, config=synthetic.config(),
                   kv_grids={kv_grid_name(g, FP8_KV): raw_frame(rows) for g, rows in fp8.items()})


CHECKS = ("every_cell", "speedups", "floor", "fp16")


def test_the_constructed_grids_pass_every_rule():
    from test_fp8_runs import passing_runs

    grids_only = targets_fp8.fp8_verdicts(fp8_results())
    assert grids_only["verdict"] == targets.NOT_MEASURED  # the full step, validate-gpu, the policy are rules too
    results = replace(fp8_results(), **passing_runs())
    assert targets_fp8.fp8_verdicts(results)["policy"]["verdict"] == targets.NOT_MEASURED  # no adaptive entry given
    out = targets_fp8.fp8_verdicts(results, claims.fp8_adaptive(results))
    json.dumps(out)
    assert out["verdict"] == targets.HOLDS and out["summary"] == "holds on test-gpu"
    for key in CHECKS:
        assert out[key]["verdict"] == targets.HOLDS, key
    assert len(out["every_cell"]["cases"]) == len(CASES)
    assert [c["measured"] for c in out["speedups"]["cases"]] == [True] * 4
    # the floor: the 67 MB-and-up cases only (B4xN4096 reads 33.5 MB, the shapes cells 8 and 33.5 MB)
    assert {e["trace"] for e in out["floor"]["cases"]} == {"B1xN131072", "B8-bimodal", "B64xN8192", "B1xN147456"}
    assert {e["trace"]: e["target"] for e in out["floor"]["cases"]}["B1xN131072"] == 0.90      # 268 MB
    assert {e["trace"]: e["target"] for e in out["floor"]["cases"]}["B8-bimodal"] == 0.80      # 266 MB
    # fp16: the cases whose fp16 step reads 537 MB or more (not the bimodal one, 533 MB)
    assert {e["trace"] for e in out["fp16"]["cases"]} == {"B1xN131072", "B64xN8192", "B1xN147456"}
    assert all(e["ratio"] == pytest.approx(1.95, rel=0.02) for e in out["fp16"]["cases"])
    named = {c["case"]: c for c in out["speedups"]["cases"]}
    assert named["Hq=4/Hkv=1 B=1 x 32K"]["ratio"] == pytest.approx(1.65, rel=0.02)
    assert named["B=1 x 128K"]["baseline"] == "flashinfer-tc"   # the unavailable FA3 row is no baseline


@pytest.mark.parametrize("planted, failing, case", [
    ({"speedup": {"B4xN4096": 0.98}}, "every_cell", "B4xN4096"),
    ({"speedup": {"B1xN131072": 1.30}}, "speedups", "B=1 x 128K"),
    ({"floor_frac": {"B1xN147456": 0.85}}, "floor", "B1xN147456"),
    ({"fp16_ratio": {"B1xN147456": 1.7}}, "fp16", "B1xN147456"),
])
def test_each_planted_miss_fails_exactly_its_rule(planted, failing, case):
    out = targets_fp8.fp8_verdicts(fp8_results(**planted))
    assert out["verdict"] == targets.FAILS and out["summary"] == "does not hold on test-gpu"
    for key in CHECKS:
        assert out[key]["verdict"] == (targets.FAILS if key == failing else targets.HOLDS), key
    (below,) = out[failing]["below"]
    assert below.startswith(case)
    assert any(targets.FAILS in s for s in out["sentences"])


def test_a_named_target_beyond_the_floor_says_so_and_keeps_its_verdict():
    """Beside each named speedup, the fastest baseline's time over the FP8 floor's: what a kernel at
    the floor would reach. Reported (a target above it is out of reach on that GPU), never judged."""
    out = targets_fp8.fp8_verdicts(fp8_results(speedup={"B1xN131072": 1.20}))    # floor at 0.95 x ours
    named = {c["case"]: c for c in out["speedups"]["cases"]}
    short = named["B=1 x 128K"]
    assert short["at_floor"] == pytest.approx(1.20 / 0.95, rel=0.02) and not short["reachable"]
    assert not short["holds"] and out["speedups"]["verdict"] == targets.FAILS
    assert f"(a kernel at the FP8 floor would reach {short['at_floor']:.3f}x here)" in " ".join(out["sentences"])
    reach = named["B=64 x 8K"]
    assert reach["at_floor"] == pytest.approx(1.30 / 0.95, rel=0.02) and reach["reachable"]
    missed = targets_fp8.fp8_verdicts(fp8_results(speedup={"B1xN131072": 1.30}))   # 1.37 at the floor: reachable
    case = {c["case"]: c for c in missed["speedups"]["cases"]}["B=1 x 128K"]
    assert case["reachable"] and not case["holds"] and "would reach" not in " ".join(missed["sentences"])


def test_the_fp8_floor_and_speedup_rules_read_the_fp8_bytes():
    """A case judged by its FP8 bytes: 302 MB of e4m3 codes is in the 0.90 band (its fp16 twin's
    604 MB would be too; 200 MB of codes is in the 0.80 band, where 0.85 holds)."""
    assert targets.floor_band(302_000_000, targets_fp8.FP8_FLOOR_BANDS) == 0.90
    assert targets.floor_band(200_000_000, targets_fp8.FP8_FLOOR_BANDS) == 0.80
    assert targets.floor_band(60_000_000, targets_fp8.FP8_FLOOR_BANDS) is None


def test_not_measured_states_the_rules():
    empty = pd.DataFrame()
    bench = synthetic.bench_frame()
    results = Results(hw="nvidia-h200", raw=empty, bench=bench, validation_gpu=empty, validation_cpu=empty,
                      ablation_buckets=empty, ablation_splits=empty, provenance={}, policy=None, kernels=None,
                      config=synthetic.config())
    out = targets_fp8.fp8_verdicts(results)
    assert out["verdict"] == targets.NOT_MEASURED and out["summary"] == "not measured on nvidia-h200"
    assert out["measured"] is False and out["files"] == {"bench_kernels_fp8": False, "bench_shapes_fp8": False}
    for key in CHECKS:
        assert out[key]["verdict"] == targets.NOT_MEASURED, key
    assert len(out["rules"]) == 7 and "1.35x at B=1 x 128K" in out["rules"][1] and "FP8 policy" in out["rules"][6]
    (sentence,) = out["sentences"]
    assert "not measured on nvidia-h200" in sentence and targets_fp8.FP8_COMMAND in sentence
    # one FP8 grid without the other: its checks are judged, the missing named cell is not measured
    part = targets_fp8.fp8_verdicts(fp8_results(grids=("bench_kernels",)))
    assert part["speedups"]["not_measured"] == ["Hq=4/Hkv=1 B=1 x 32K"]
    assert part["speedups"]["verdict"] == targets.NOT_MEASURED and part["verdict"] == targets.NOT_MEASURED
    assert part["every_cell"]["verdict"] == targets.HOLDS


def test_the_committed_claims_judge_the_committed_fp8_files():
    """claims.json's fp8 entry is the judgement of the FP8 files committed beside it: the grid's
    run, every one of its cases in the every-cell rule, the logits' models, and not-measured
    entries exactly where no file is committed."""
    hw = ROOT / "results" / "nvidia-h200"
    fp8 = json.loads((hw / "claims.json").read_text())["fp8"]
    grids = [pd.read_parquet(path) for path in (hw / "bench_kernels_fp8.parquet", hw / "bench_shapes_fp8.parquet")
             if path.is_file()]
    assert fp8["measured"] and fp8["files"] == {"bench_kernels_fp8": True,
                                                "bench_shapes_fp8": (hw / "bench_shapes_fp8.parquet").is_file()}
    assert fp8["run_ids"] == sorted({r for grid in grids for r in grid["run_id"].unique().tolist()})
    cells = sum(grid.loc[(grid["protocol"] == "kernel") & (grid["backend"] == "pkv-workqueue"),
                         ["trace", "num_qo_heads", "num_kv_heads"]].drop_duplicates().shape[0] for grid in grids)
    assert len(fp8["every_cell"]["cases"]) == cells
    logits = pd.read_parquet(hw / "fp8_logits.parquet")
    assert len(fp8["logits"]["cases"]) == logits.groupby(["model", "scales"]).ngroups
    assert (fp8["validation"]["verdict"] == targets.NOT_MEASURED) == (not (hw / "validation_gpu_fp8.parquet").is_file())
    assert (fp8["e2e"]["verdict"] == targets.NOT_MEASURED) == (not (hw / "e2e_fp8").is_dir())


# -- the workflow ---------------------------------------------------------------------------------
def _with_target(tmp_path, kv_dtypes=None):
    copy = copy_workflow(tmp_path / "copy")
    path = copy / "config" / "config.yaml"
    text = path.read_text().replace("target: auto ", "target: nvidia-h200 ", 1)
    if kv_dtypes is not None:
        text = text.replace("kv_dtypes: [float8_e4m3]", f"kv_dtypes: {json.dumps(kv_dtypes)}", 1)
    path.write_text(text)
    return copy


def _env(tmp_path):
    """A host without a working GPU: nvidia-smi fails, the tests' interpreter runs the jobs."""
    return gpu_env(tmp_path / "bin", None)


@needs_snakemake
def test_the_fp8_grids_are_gpu_jobs_of_all(tmp_path):
    copy = _with_target(tmp_path)
    done = snakemake(copy, "-n", "-p", "all", env=_env(tmp_path))
    assert done.returncode == 0, done.stderr + done.stdout
    counts = job_counts(done.stdout)
    assert counts["bench_kernels_fp8"] == counts["bench_shapes_fp8"] == 1
    blocks = {b.split(":", 1)[0]: b for b in done.stdout.split("\nrule ")[1:]}
    for grid, command in (("bench_kernels", "bench-kernels"), ("bench_shapes", "bench-shapes")):
        mine = blocks[f"{grid}_fp8"]
        assert (f"output: results/nvidia-h200/{grid}_fp8.parquet, results/nvidia-h200/{grid}_fp8.json") in mine
        assert "gpu=1" in mine
        assert (f"--gpu nvidia-h200 -- persistentkv {command} --config config/config.yaml --kv-dtype float8_e4m3"
                f" --out results/nvidia-h200/{grid}_fp8.parquet > logs/measure/nvidia-h200/{grid}_fp8.log") in mine
        assert f"results/nvidia-h200/{grid}_fp8.json" in blocks["provenance"].split("output:")[0]
        claims = next(b for name, b in blocks.items() if name == "render_claims" and "nvidia-h200" in b)
        assert f"results/nvidia-h200/{grid}_fp8.parquet" in claims.split("output:")[0]
    named = snakemake(copy, "-n", "bench_kernels_fp8", "bench_shapes_fp8", env=_env(tmp_path))
    assert named.returncode == 0, named.stderr
    assert {k: v for k, v in job_counts(named.stdout).items() if k.endswith("_fp8")} == \
        {"bench_kernels_fp8": 1, "bench_shapes_fp8": 1}


@needs_snakemake
def test_each_fp8_job_runs_its_own_command(tmp_path):
    """The jobs run (a stand-in persistentkv records bench-kernels' calls; bench-shapes runs for real
    and stops without a GPU): each rule made in the loop over the grids runs its own grid's command."""
    copy = _with_target(tmp_path)
    env = fake_gpu_env(tmp_path, ["NVIDIA H200"])
    done = snakemake(copy, "bench_kernels_fp8", "bench_shapes_fp8", "--cores", "2", "--keep-going", "--resources",
                     "gpu=1", env=env)
    assert done.returncode != 0          # bench_shapes_fp8, for real on a host without a GPU
    calls = [(c["command"], c["out"]) for c in fake_calls(tmp_path) if c["command"] != "compile-kernels"]
    assert calls == [("bench-kernels", "results/nvidia-h200/bench_kernels_fp8.parquet")]
    assert (copy / "results" / "nvidia-h200" / "bench_kernels_fp8.json").is_file()
    shapes_log = (copy / "logs" / "measure" / "nvidia-h200" / "bench_shapes_fp8.log").read_text()
    assert "no CUDA device" in shapes_log


@needs_snakemake
def test_no_kv_dtypes_no_fp8_jobs_and_a_bad_one_stops_in_one_line(tmp_path):
    none = _with_target(tmp_path / "none", kv_dtypes=[])
    done = snakemake(none, "-n", "all", env=_env(tmp_path))
    assert done.returncode == 0, done.stderr + done.stdout
    assert not any(k.endswith("_fp8") for k in job_counts(done.stdout))
    bad = _with_target(tmp_path / "bad", kv_dtypes=["float8_e5m2"])
    done = snakemake(bad, "-n", "all", env=_env(tmp_path))
    assert done.returncode != 0
    assert "error: config: measure.kv_dtypes[0]: 'float8_e5m2' is not one of ['float8_e4m3']" in done.stderr


def test_the_config_refuses_an_unknown_kv_dtype():
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    config["measure"]["kv_dtypes"] = ["float8_e5m2"]
    with pytest.raises(PKVError, match=r"^config: measure.kv_dtypes\[0\]: 'float8_e5m2' is not one of"):
        configuration.validate_config(config, ROOT)
    assert AttentionSpec().kv_dtype is None and replace(AttentionSpec(), kv_dtype=FP8_KV).kv_itemsize == 1


# -- rendering ------------------------------------------------------------------------------------
def test_the_fp8_figure_draws_both_caches_from_a_constructed_frame(tmp_path):
    from persistentkv.render import figures

    frame = figures.data_fp8(fp8_results())
    assert set(frame["kv_dtype"]) == {"float16", FP8_KV}
    b128 = frame.set_index(["kv_dtype", "trace"]).loc[(FP8_KV, "B1xN131072")]
    assert b128["kv_bytes"] == 131072 * 2048 and b128["baseline_name"] == "flashinfer-tc"
    assert b128["floor"] / b128["ours"] == pytest.approx(0.95, rel=0.02)
    fig = figures.fig_fp8(frame, "test-gpu")
    floors = [line for line in fig.axes[0].get_lines() if "one-kernel floor" in str(line.get_label())]
    assert len(floors) == 2                                   # one floor line per cache
    # a case's two caches share an x on the left (the fp16 bytes); on the right the floor fraction
    # against the cache's own bytes, with one black segment per FP8 floor band
    assert b128["fp16_bytes"] == 2 * b128["kv_bytes"]
    fp16_twin = frame.set_index(["kv_dtype", "trace"]).loc[("float16", "B1xN131072")]
    assert fp16_twin["fp16_bytes"] == fp16_twin["kv_bytes"] == b128["fp16_bytes"]
    from matplotlib.collections import LineCollection

    bands = [c for c in fig.axes[1].collections if isinstance(c, LineCollection) and len(c.get_segments()) == 1]
    assert sorted(round(float(c.get_segments()[0][0][1]), 2) for c in bands) == sorted(
        t for _, _, t in targets_fp8.FP8_FLOOR_BANDS)
    path = tmp_path / "fp8.svg"
    figures.save(fig, path)
    assert path.stat().st_size > 10_000 and b"<svg" in path.read_bytes()[:500]
    # no FP8 rows, no figure data: the report then says it is not measured instead
    without = Results(hw="test-gpu", raw=pd.DataFrame(), bench=fp8_results().bench, validation_gpu=pd.DataFrame(),
                      validation_cpu=pd.DataFrame(), ablation_buckets=pd.DataFrame(), ablation_splits=pd.DataFrame(),
                      provenance={}, policy=None, kernels=None, config=synthetic.config())
    assert figures.data_fp8(without).empty


def test_the_report_and_paper_sections_say_what_was_measured():
    from persistentkv.render import report, tables

    html = report.environment().get_template("fp8.html.j2")
    tex = tables.environment().get_template("fp8.tex.j2")
    missing = targets_fp8.fp8_verdicts(Results(hw="nvidia-h200", raw=pd.DataFrame(), bench=pd.DataFrame(),
                                               validation_gpu=pd.DataFrame(), validation_cpu=pd.DataFrame(),
                                               ablation_buckets=pd.DataFrame(), ablation_splits=pd.DataFrame(),
                                               provenance={}, policy=None, kernels=None, config=synthetic.config()))
    page = html.render(fp8=missing, fp8_figure=None, fp8_unavailable=[], hw="nvidia-h200", ratio_ci=report.ratio_ci)
    assert "has not been measured on nvidia-h200" in page and "snakemake bench_kernels_fp8 --cores all" in page
    assert "<table" not in page and "<img" not in page
    # in the report the figure stands there too, as its placeholder (figures.fig_fp8 without FP8 rows)
    page = html.render(fp8=missing, fp8_figure="data:image/svg+xml;base64,AA==", fp8_unavailable=[],
                       hw="nvidia-h200", ratio_ci=report.ratio_ci)
    assert page.count('data-figure="fp8"') == 1 and "has not been measured" in page
    text = tex.render(fp8=missing, hw="nvidia-h200")
    assert [line for line in text.splitlines() if not line.startswith("%")] == [
        r"\emph{The FP8 grid has not been measured on nvidia-h200: \texttt{snakemake bench\_kernels\_fp8 --cores "
        r"all} measures it.}"]
    measured = fp8_results(speedup={"B1xN131072": 1.30})
    uri = "data:image/svg+xml;base64,AA=="  # the fp8 figure's SVG, as render() reads it from the figures folder
    context = report.fp8_context(targets_fp8.fp8_verdicts(measured), measured, uri)
    assert context["fp8_figure"] == uri
    assert context["fp8_unavailable"] == [{"file": "bench_kernels_fp8", "backend": "vllm-fa3",
                                           "reason": "vLLM FA3 with an FP8 cache writes bfloat16 only"}]
    page = html.render(**context, hw="test-gpu", ratio_ci=report.ratio_ci)
    assert page.count("<tr><td>B=1 x 128K") == 1 and "does not hold" in page and "<img" in page
    text = tex.render(fp8=context["fp8"], hw="test-gpu")
    row = next(line for line in text.splitlines() if line.startswith("B=1 x 128K"))
    assert r"& bench\_kernels\_fp8 & 1.2" in row and row.endswith(r"& 1.35 & does not hold \\")
