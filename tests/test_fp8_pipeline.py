"""The FP8 KV cache as a pipeline axis: bench-kernels / bench-shapes --kv-dtype, the kv_dtype column
and the loader's fill for files without it, and the Snakemake targets of config measure.kv_dtypes."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import yaml
from workflow_support import NO_GPU, ROOT, copy_workflow, job_counts, needs_snakemake, snakemake

import synthetic
from persistentkv import cli, configuration, targets
from persistentkv.commands import bench_kernels, bench_shapes
from persistentkv.commands.measure import parse_kv_dtype
from persistentkv.errors import PKVError
from persistentkv.measure import runner
from persistentkv.measure.rows import RAW_COLUMNS, raw_frame, raw_row
from persistentkv.measure.workload import shapes_cases
from persistentkv.names import FP8_KV, kv_grid_name
from persistentkv.results import load_results
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


def test_the_committed_files_read_as_caches_of_their_query_dtype():
    loaded = load_results(ROOT / "results" / "nvidia-h200", ROOT / "results" / "counters", CONFIG)
    for frame in (loaded.bench, loaded.shapes, loaded.raw):
        assert not frame.empty and (frame["kv_dtype"] == frame["dtype"]).all()
    assert loaded.kv_grids == {}


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
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text(NO_GPU)
    (bin_dir / "nvidia-smi").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


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
