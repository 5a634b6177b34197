"""validate-cpu: step sampling, the compact cache, agreement with float64, and failing loudly."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from persistentkv import cli, configuration, io, reference, traces
from persistentkv.cache import allocate, batch_for_step, compact_batch, random_cache
from persistentkv.commands import validate_cpu
from persistentkv.errors import PKVError
from persistentkv.spec import AttentionSpec
from persistentkv.traces import Step

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 64, "page_size": 16, "dtype": "float16"}
#: Ragged rows, page-boundary lengths (16, 32, 47/48/49) and a long-ish one (1000 tokens).
TINY_CSV = ("request_id,arrival_step,prompt_len,decode_steps\n"
            "0,0,47,6\n1,0,1000,4\n2,1,16,5\n3,1,300,3\n4,2,31,6\n")


def small_config(tmp_path: Path) -> Path:
    """The committed grid on a small attention shape and one tiny file trace."""
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    csv = tmp_path / "tiny.csv"
    csv.write_text(TINY_CSV)
    config["spec"] = dict(SMALL)
    config["traces"] = [{"name": "tiny", "kind": "file", "path": str(csv), "max_active": 3, "num_steps": 6,
                         "splits": 4}]
    config["ablations"]["buckets"]["traces"] = ["tiny"]
    config["ablations"]["splits"] = {"traces": ["tiny"], "values": [1, 2, 4]}
    config["measure"]["fragmented"]["traces"] = ["tiny"]
    config["measure"]["gqa_sweep"] = {"trace": "tiny", "group_sizes": [1, 2, 4]}
    config["planner"]["target_items"] = 16
    config["validation"]["cpu"]["steps_per_trace"] = 3
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory) -> traces.Trace:
    csv = tmp_path_factory.mktemp("tiny") / "tiny.csv"
    csv.write_text(TINY_CSV)
    return traces.from_file(csv, max_active=3, num_steps=6, name="tiny")


def trace_of(totals) -> traces.Trace:
    return traces.Trace("t", "file", 0, 1, (), tuple(Step(i, (0,), (int(t),)) for i, t in enumerate(totals)))


@pytest.mark.parametrize("totals, count, expected", [
    ([5, 9, 7, 9, 1], 2, [0, 1]),          # the first, then the longest (the first maximum)
    ([5, 9, 7, 9, 1], 1, [0]),             # one step: the first
    ([9, 1, 2], 2, [0, 2]),                # the first is the longest: the spread adds the last
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, [0, 3, 5, 8]),
    ([3, 2, 1], 7, [0, 1, 2]),             # more than there are: all
])
def test_the_sampler_validate_cpu_uses(totals, count, expected):
    """validate-cpu samples with traces.sampled_steps, the GPU validation's sampler."""
    assert validate_cpu.sampled_steps is traces.sampled_steps
    picked = traces.sampled_steps(trace_of(totals), count)
    assert picked == expected
    assert picked == sorted(set(picked)) and len(picked) == min(count, len(totals))


def test_sampler_rejects_zero():
    with pytest.raises(PKVError, match="steps_per_trace must be >= 1, got 0"):
        traces.sampled_steps(trace_of([1, 2]), 0)


def test_compact_batch_reads_the_same_tokens_as_the_full_cache(tiny_trace):
    spec = AttentionSpec(**SMALL)
    trace = tiny_trace
    allocation = allocate(trace.requests, spec.page_size, 0.5, 7)  # holes: scattered physical ids
    step = trace.steps[-1]
    full = batch_for_step(spec, allocation, step)
    compact, used = compact_batch(full)
    assert compact.num_pages == used.size < full.num_pages
    assert np.all(np.diff(used) > 0)
    np.testing.assert_array_equal(used[compact.kv_indices], full.kv_indices)  # same pages, renumbered by rank
    k_full, _ = random_cache(spec, full.num_pages, 3)
    k_small = k_full[used]
    for row in range(full.batch_size):
        n = int(full.seq_lens[row])
        np.testing.assert_array_equal(reference.gather_row(k_small, compact, row, 0, n),
                                      reference.gather_row(k_full, full, row, 0, n))


def test_step_cache_is_seeded_chunked_and_fp16(monkeypatch):
    monkeypatch.setattr(validate_cpu, "CACHE_CHUNK_PAGES", 3)
    spec = AttentionSpec(**SMALL)
    k1, v1 = validate_cpu.step_cache(spec, 8, 5)
    k2, v2 = validate_cpu.step_cache(spec, 8, 5)
    assert k1.dtype == np.float16 and k1.shape == (8, 16, 2, 64)
    np.testing.assert_array_equal(k1, k2)
    np.testing.assert_array_equal(v1, v2)
    assert not np.array_equal(k1[:3], k1[3:6])  # chunks differ (seed + chunk)
    assert 0.8 < float(k1.astype(np.float64).std()) < 1.2


def test_validate_trace_agrees_with_float64(tiny_trace):
    spec = AttentionSpec(**SMALL)
    rows = validate_cpu.validate_trace(tiny_trace, spec, 4, {"target_items": 16, "min_chunk_tiles": 1}, 3, 2e-3)
    frame = pd.DataFrame(rows)
    assert len(frame) == 3 * 3
    assert set(frame["route"]) == {"workqueue", "buckets", "split"}
    assert frame["passed"].all() and (frame["nan_count"] == 0).all()
    # FP16 output rounding sets the floor (~2**-12 relative); a wrong split or merge is far above it.
    assert frame["rel_err"].max() < 1e-3


def run_cli(argv, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def make_traces(config: Path, out_dir: Path, capsys) -> None:
    seed = configuration.calibration_seed(configuration.load_config(config))
    code, _, err = run_cli(["traces", "--config", str(config), "--trace", "tiny", "--seed", str(seed),
                            "--out", str(out_dir / f"tiny_s{seed}.json")], capsys)
    assert code == 0, err


def test_cli_writes_the_table(tmp_path, capsys):
    config = small_config(tmp_path)
    make_traces(config, tmp_path / "traces", capsys)
    out = tmp_path / "validation_cpu.parquet"
    code, stdout, err = run_cli(["validate-cpu", "--config", str(config), "--traces-dir", str(tmp_path / "traces"),
                                 "--out", str(out), "--no-progress"], capsys)
    assert code == 0, err
    frame = pd.read_parquet(out)
    for column in ("trace", "seed", "step", "route", "rel_err", "max_row_head_err", "worst_row", "worst_head",
                   "row_heads_failing", "max_abs_err", "rtol", "passed", "nan_count", "reason"):
        assert column in frame.columns  # docs/DATA.md
    assert frame["passed"].dtype == bool and frame["passed"].all()
    assert (frame["rtol"] == 2e-3).all() and len(frame) == 9
    assert "9 runs, 9 passed" in stdout
    for column in ("rel_err", "max_row_head_err", "max_abs_err"):
        assert (frame[column] > 0).all()
        assert [io.significant(float(v), "error") for v in frame[column]] == frame[column].tolist()


def test_worker_processes_write_the_same_bytes(tmp_path, capsys):
    """--jobs 3 (spawned workers, one BLAS thread each) writes the file --jobs 1 writes, byte for byte."""
    config = small_config(tmp_path)
    make_traces(config, tmp_path / "traces", capsys)
    outs = []
    for jobs in (1, 3):
        out = tmp_path / f"validation_cpu_{jobs}.parquet"
        code, stdout, err = run_cli(["validate-cpu", "--config", str(config), "--traces-dir", str(tmp_path / "traces"),
                                     "--out", str(out), "--jobs", str(jobs), "--no-progress"], capsys)
        assert code == 0 and "9 runs, 9 passed" in stdout, err
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    code, _, err = run_cli(["validate-cpu", "--config", str(config), "--traces-dir", str(tmp_path / "traces"),
                            "--out", str(tmp_path / "v.parquet"), "--jobs", "0"], capsys)
    assert code == 2 and err.strip() == "error: --jobs must be >= 1, got 0"


def test_workers_that_die_leave_the_rows_to_this_process(tmp_path, capsys):
    """An entry script without a __main__ guard (each spawned worker runs the command again and dies
    starting its own): one warning, then the steps in this process, the bytes --jobs 1 writes."""
    config = small_config(tmp_path)
    make_traces(config, tmp_path / "traces", capsys)
    common = ["validate-cpu", "--config", str(config), "--traces-dir", str(tmp_path / "traces"), "--no-progress"]
    code, _, err = run_cli(common + ["--out", str(tmp_path / "one.parquet")], capsys)
    assert code == 0, err
    script = tmp_path / "unguarded.py"
    script.write_text("import sys\nfrom persistentkv.cli import main\nsys.exit(main())\n")
    out = tmp_path / "two.parquet"
    done = subprocess.run([sys.executable, str(script), *common, "--out", str(out), "--jobs", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert validate_cpu.WORKERS_DIED in done.stderr and "9 runs, 9 passed" in done.stdout
    assert out.read_bytes() == (tmp_path / "one.parquet").read_bytes()


@pytest.mark.parametrize("jobs, tasks, available, expected", [
    (8, 14, 64 << 30, 8),      # memory for all of them
    (8, 14, 10 << 30, 3),      # 3 GiB each
    (8, 14, 1 << 30, 1),       # never fewer than one
    (8, 5, None, 5),           # no more workers than steps; memory not known: not capped
    (8, 14, None, 8),
])
def test_workers_are_capped_by_steps_and_available_memory(jobs, tasks, available, expected):
    assert validate_cpu.workers_for(jobs, tasks, available) == expected


def test_cli_fails_after_writing_when_a_route_is_wrong(tmp_path, capsys, monkeypatch):
    config = small_config(tmp_path)
    make_traces(config, tmp_path / "traces", capsys)
    real = validate_cpu.execute_plan

    def broken(plan, q, k, v, batch, **kw):
        out = real(plan, q, k, v, batch, **kw)
        if plan.route == "buckets":
            out[0, 0, :] += 1  # one wrong head of one row
        return out

    monkeypatch.setattr(validate_cpu, "execute_plan", broken)
    out = tmp_path / "validation_cpu.parquet"
    code, _, err = run_cli(["validate-cpu", "--config", str(config), "--traces-dir", str(tmp_path / "traces"),
                            "--out", str(out), "--no-progress"], capsys)
    assert code == 1
    frame = pd.read_parquet(out)  # written before failing
    assert not frame.loc[frame["route"] == "buckets", "passed"].any()
    assert frame.loc[frame["route"] != "buckets", "passed"].all()
    assert err.count("FAILED tiny") == 3 and err.count(": row 0 head 0 (") == 3
    wrong = frame[frame["route"] == "buckets"]
    assert (wrong["worst_row"] == 0).all() and (wrong["worst_head"] == 0).all() and (wrong["row_heads_failing"] >= 1).all()


def test_cli_missing_trace_is_one_line(tmp_path, capsys):
    config = small_config(tmp_path)
    code, _, err = run_cli(["validate-cpu", "--config", str(config), "--traces-dir", str(tmp_path / "none"),
                            "--out", str(tmp_path / "v.parquet")], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: trace ") and "does not exist" in err
    assert not (tmp_path / "v.parquet").exists()


@pytest.mark.parametrize("jobs", [1, 2])
def test_the_progress_bar_counts_every_run_and_ends_full(tmp_path, capsys, jobs):
    """The bar's total is the runs the command makes (routes x sampled steps), it ticks once per row
    written, in the process and through workers, and it ends at its total."""
    config = small_config(tmp_path)
    make_traces(config, tmp_path / "traces", capsys)
    out = tmp_path / "validation_cpu.parquet"
    code, stdout, err = run_cli(["validate-cpu", "--config", str(config), "--traces-dir", str(tmp_path / "traces"),
                                 "--out", str(out), "--jobs", str(jobs)], capsys)
    assert code == 0, err
    rows = len(pd.read_parquet(out))
    assert rows == 9 and rows == validate_cpu.ROUTES_PER_STEP * 3
    counts = re.findall(r"validate-cpu: .*?(\d+)/(\d+) \[", err)
    assert counts and counts[-1] == (str(rows), str(rows))
