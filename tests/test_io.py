"""Atomic writes: a writer killed mid-write (SIGKILL, no cleanup) leaves the previous file whole,
and what it leaves behind is never read as a result."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from persistentkv import io
from persistentkv.results import load_results

#: A child that writes a frame big enough (128 MB of random float64, about half a second of
#: parquet encoding here) to be caught mid-write, through the library's atomic writer.
CHILD = """
import sys
import numpy as np
import numpy as np
import pandas as pd
from persistentkv.io import atomic_write_parquet

frame = pd.DataFrame(np.random.default_rng(0).standard_normal((4_000_000, 4)), columns=list("abcd"))
atomic_write_parquet(sys.argv[1], frame)
"""


def temporaries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.startswith("."))


def timing_rows() -> pd.DataFrame:
    return pd.DataFrame({"run_id": ["r"] * 3, "experiment": ["published"] * 3, "trace": ["t"] * 3,
                         "backend": ["pkv-workqueue"] * 3, "protocol": ["kernel"] * 3,
                         "time_us": [1.0, 2.0, 3.0], "status": ["ok"] * 3})


def test_the_temporary_name_is_hidden_and_ends_in_no_data_suffix(tmp_path):
    target = tmp_path / "out" / "rows.parquet"
    with io.atomic_path(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".rows.parquet.")
        assert tmp.suffix == ".tmp" and not tmp.name.endswith(".parquet")
        tmp.write_text("done")
    assert target.read_text() == "done" and temporaries(target.parent) == []


def test_a_killed_writer_leaves_the_previous_file_and_nothing_a_loader_reads(tmp_path):
    raw = tmp_path / "results" / "test-gpu" / "raw"
    target = raw / "published.parquet"
    before = timing_rows()
    io.atomic_write_parquet(target, before)
    env = {**os.environ, "PYTHONPATH": str(Path(io.__file__).resolve().parents[1])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(target)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not any(p.stat().st_size > 0 for p in temporaries(raw) if p.exists()):
            assert child.poll() is None, "the writer finished before it could be killed: enlarge its frame"
            assert time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.001)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL
    (left,) = temporaries(raw)                      # killed mid-write: its temporary file stays...
    assert left.stat().st_size > 0 and left.name.endswith(".tmp")
    pd.testing.assert_frame_equal(pd.read_parquet(target), before)   # ...and the previous file is whole
    results = load_results(raw.parent, tmp_path / "results" / "counters")
    assert [k for k in results.found if k.startswith("raw/")] == ["raw/published"]
    pd.testing.assert_frame_equal(results.raw, before)


@pytest.mark.parametrize("leftover", [".published.parquet.x1y2.parquet", ".published.json.x1y2.json"])
def test_the_loader_skips_hidden_files_whatever_they_end_in(tmp_path, leftover):
    """A temporary file of the old naming (it kept the data suffix) is no result either."""
    raw = tmp_path / "hw" / "raw"
    io.atomic_write_parquet(raw / "published.parquet", timing_rows())
    (raw / leftover).write_bytes(b"PAR1 half a file")
    results = load_results(raw.parent, tmp_path / "counters")
    assert len(results.raw) == 3 and set(results.found) == {"raw/published"}
    assert results.provenance == {}


def test_a_failed_write_removes_its_temporary_file(tmp_path):
    target = tmp_path / "rows.parquet"
    io.atomic_write_parquet(target, timing_rows())
    with pytest.raises(ValueError):
        io.atomic_write_parquet(target, pd.DataFrame({"a": [object()]}))
    assert temporaries(tmp_path) == []
    pd.testing.assert_frame_equal(pd.read_parquet(target), timing_rows())


def test_a_stale_merge_names_no_run_whose_rows_and_sidecar_are_gone(tmp_path):
    """provenance.json older than the sidecars beside it (a single target rerun without rule
    provenance): a run id that no sidecar and no row holds any more is left out, and said."""
    import json

    hw = tmp_path / "hw"
    io.atomic_write_parquet(hw / "raw" / "published.parquet", timing_rows())             # run "r"
    (hw / "raw" / "published.json").write_text(json.dumps({"r": {"gpu": "G", "git_commit": "new"}}))
    (hw / "provenance.json").write_text(json.dumps({"old": {"gpu": "G", "git_commit": "gone"},
                                                    "r": {"gpu": "G", "git_commit": "new"}}))
    with pytest.warns(UserWarning, match=r"names runs whose rows and sidecars are gone \(old\); left out"):
        results = load_results(hw, tmp_path / "counters")
    assert results.provenance == {"r": {"gpu": "G", "git_commit": "new"}}
    # a record whose rows are there stays, with no sidecar (results written as a merge only)
    (hw / "raw" / "published.json").unlink()
    with pytest.warns(UserWarning, match=r"\(old\); left out"):
        results = load_results(hw, tmp_path / "counters")
    assert results.provenance == {"r": {"gpu": "G", "git_commit": "new"}}


def test_the_loader_reads_rows_before_the_fp8_columns_as_the_query_dtype(tmp_path):
    """validation_gpu and e2e files written before ``kv_dtype`` (and validation's ``fp8_query``)
    load with the cache of the query's dtype and no FP8 query; files that have them keep theirs."""
    hw = tmp_path / "gpu-x"
    (hw / "e2e").mkdir(parents=True)
    old = pd.DataFrame({"backend": ["a", "b"], "dtype": ["float16", "bfloat16"], "passed": [True, True]})
    io.atomic_write_parquet(hw / "validation_gpu.parquet", old)
    io.atomic_write_parquet(hw / "e2e" / "pass1.parquet", old[["backend", "dtype"]])
    results = load_results(hw, counters_dir=tmp_path / "counters")
    assert results.validation_gpu["kv_dtype"].tolist() == ["float16", "bfloat16"]
    assert not results.validation_gpu["fp8_query"].any()
    assert results.e2e["kv_dtype"].tolist() == ["float16", "bfloat16"]
    new = old.assign(kv_dtype="float8_e4m3", fp8_query=[False, True])
    io.atomic_write_parquet(hw / "validation_gpu.parquet", new)
    io.atomic_write_parquet(hw / "e2e" / "pass1.parquet", new[["backend", "dtype", "kv_dtype"]])
    results = load_results(hw, counters_dir=tmp_path / "counters")
    assert set(results.validation_gpu["kv_dtype"]) == {"float8_e4m3"}
    assert results.validation_gpu["fp8_query"].tolist() == [False, True]
    assert set(results.e2e["kv_dtype"]) == {"float8_e4m3"}


def test_significant_rounds_as_each_quantity_is_published():
    assert io.significant(0.00025306297975026646, "error") == 0.00025
    assert io.significant(0.00026312, "error") == 0.00026
    assert io.significant(1.0467098179032832, "claims") == 1.046709   # 05UP: toward zero...
    assert io.significant(1.0467100000000002, "claims") == 1.046711   # ...unless that ends in 0 or 5
    assert io.significant(-8803.168296813965, "claims") == -8803.168
    assert io.significant(4.0625, "claims") == 4.0625 and io.significant(16.0, "claims") == 16.0   # exact stays
    for kept in (0.0, math.inf, -math.inf, 3, True, None, "x"):
        assert io.significant(kept, "claims") == kept
    assert math.isnan(io.significant(math.nan, "error"))
    for quantity in ("error", "claims"):   # a published value stays as it is
        for x in (0.9799999, 0.00026, 1.046711, 2.1254833741883578e-4):
            once = io.significant(x, quantity)
            assert io.significant(once, quantity) == once


@pytest.mark.parametrize("value, shown", [(15.226500012, "15.227"), (15.22649999, "15.226"), (10580.5000001, "10581"),
                                          (0.98449999, "0.984"), (1.23450000001, "1.235")])
def test_claims_precision_prints_as_the_unrounded_value(value, shown):
    """Rounded to nearest at 7 digits, 15.226500012 would be 15.22650 and print as 15.226."""
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    assert f"{value:.{decimals}f}" == shown
    assert f"{io.significant(value, 'claims'):.{decimals}f}" == shown


def test_round_floats_and_columns_round_floats_only():
    payload = {"a": [np.float64(1.23456789), np.float32(0.000123456), 7, None, "x"], "b": {"c": (0.1234567891,)}}
    assert io.round_floats(payload, "claims") == {"a": [1.234567, 0.0001234561, 7, None, "x"], "b": {"c": [0.1234567]}}
    frame = pd.DataFrame({"rel_err": [1.23456e-4, np.nan, np.inf], "n": [1, 2, 3]})
    rounded = io.round_columns(frame, ["rel_err", "n", "absent"], "error")
    assert rounded["rel_err"].iloc[0] == 1.2e-4 and np.isnan(rounded["rel_err"].iloc[1])
    assert rounded["rel_err"].iloc[2] == np.inf and rounded["n"].tolist() == [1, 2, 3]
    assert frame["rel_err"].iloc[0] == 1.23456e-4   # the input is left as it was


def test_numbers_one_ulp_apart_publish_the_same():
    """What a different summation order changes (the last bits) is gone after rounding."""
    for x in (2.1254833741883578e-4, 1.0822727812071744, 8803.168296813965):
        for quantity in ("error", "claims"):
            assert io.significant(np.nextafter(x, np.inf), quantity) == io.significant(np.nextafter(x, -np.inf), quantity)
