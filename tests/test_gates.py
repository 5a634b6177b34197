"""The correctness gates judge each (row, query head) against float64, not one norm over a batch.

A long row's attention output averages many V rows, so its norm is small: an error of a few
percent in that row alone moves ||out - ref|| / ||ref|| over the whole batch far less than any
tolerance. Each gate must fail such an output and name the row: reference.gate, validate-gpu's
(measure.validation.compare), validate-cpu's (commands.validate_cpu.errors) and the GPU tests'
(gpu_support.assert_rows_close, run here on CPU tensors). Fresh random data for every case.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpu_support import assert_rows_close, row_head_errors_torch
from persistentkv.cache import make_batch, random_cache, random_queries
from persistentkv.commands import validate_cpu
from persistentkv.errors import PKVError
from persistentkv.measure import validation
from persistentkv.plan import make_plan
from persistentkv.reference import (
    TOLERANCE, execute_plan, gate, gate_errors, reference_decode, relative_error, row_head_errors, tolerance,
)
from persistentkv.spec import AttentionSpec

torch = pytest.importorskip("torch")

SPEC = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="float16")
LONG_ROW, LONG_TOKENS = 17, 9000
#: The planted error: each head of the long row off by this fraction of its reference norm.
PLANTED = 0.03


@pytest.fixture(scope="module")
def planted():
    """(batch, executed float16 output, the same output with the long row 3 % off, float64 ref)
    over 40 short rows (1..300 tokens) and one row of 9000 tokens, on fresh random data."""
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 31))
    lengths = rng.integers(1, 300, size=40)
    lengths[LONG_ROW] = LONG_TOKENS
    batch = make_batch(SPEC, lengths, hole_fraction=0.25, seed=seed)
    k, v = random_cache(SPEC, batch.num_pages, seed)
    q = random_queries(SPEC, batch.batch_size, seed)
    ref = reference_decode(q, k, v, batch)
    out = execute_plan(make_plan(batch, "workqueue", target_items=64), q, k, v, batch)
    noise = rng.standard_normal(ref[LONG_ROW].shape)
    noise *= (PLANTED * np.linalg.norm(ref[LONG_ROW], axis=-1) / np.linalg.norm(noise, axis=-1))[:, None]
    wrong = out.astype(np.float64)
    wrong[LONG_ROW] += noise
    return batch, out, wrong.astype(np.float16), ref


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_whole_batch_norm_would_pass_the_planted_error(planted, dtype):
    batch, _, wrong, ref = planted
    assert relative_error(wrong, ref) <= TOLERANCE[dtype]          # what the old gates judged
    errors = row_head_errors(wrong, ref)
    assert errors.shape == (batch.batch_size, SPEC.num_qo_heads)
    assert np.all(errors[LONG_ROW] > 0.9 * PLANTED)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_reference_gate_fails_the_planted_row(planted, dtype):
    batch, _, wrong, ref = planted
    verdict = gate(wrong, ref, dtype, batch.seq_lens)
    assert not verdict.passed and verdict.worst_row == LONG_ROW
    assert verdict.failing == SPEC.num_qo_heads and verdict.total == batch.batch_size * SPEC.num_qo_heads
    assert verdict.max_err == pytest.approx(PLANTED, rel=0.1) and verdict.tol == TOLERANCE[dtype]
    line = verdict.describe()
    assert line.startswith(f"row {LONG_ROW} head {verdict.worst_head} ({LONG_TOKENS} tokens): rel err ")
    assert f"> {TOLERANCE[dtype]:.0e}; 8 of {verdict.total} (row, head) over" in line


def test_validate_gpu_compare_fails_the_planted_row(planted):
    batch, _, wrong, ref = planted
    got = validation.compare(wrong, ref, TOLERANCE["float16"], batch.seq_lens)
    assert got["rel_err"] <= TOLERANCE["float16"]
    assert not got["passed"] and got["worst_row"] == LONG_ROW and got["row_heads_failing"] == SPEC.num_qo_heads
    assert got["max_row_head_err"] > TOLERANCE["float16"]
    assert got["reason"].startswith(f"row {LONG_ROW} head {got['worst_head']} ({LONG_TOKENS} tokens)")


def test_validate_cpu_errors_fail_the_planted_row(planted):
    batch, _, wrong, ref = planted
    got = validate_cpu.errors(wrong, ref, TOLERANCE["float16"], batch.seq_lens)
    assert got["rel_err"] <= TOLERANCE["float16"]
    assert not got["passed"] and got["worst_row"] == LONG_ROW and got["row_heads_failing"] == SPEC.num_qo_heads
    assert got["reason"].startswith(f"row {LONG_ROW} head {got['worst_head']} ({LONG_TOKENS} tokens)")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_assert_rows_close_fails_the_planted_row(planted, dtype):
    batch, _, wrong, ref = planted
    with pytest.raises(AssertionError, match=rf"^planted: row {LONG_ROW} head \d+ \({LONG_TOKENS} tokens\): rel err"):
        assert_rows_close(torch.from_numpy(wrong), torch.from_numpy(ref), dtype, "planted", seq_lens=batch.seq_lens)
    with pytest.raises(AssertionError, match=rf"^row {LONG_ROW} head \d+: rel err .* > {TOLERANCE[dtype]:.0e}"):
        assert_rows_close(torch.from_numpy(wrong), torch.from_numpy(ref), TOLERANCE[dtype])


def test_every_gate_passes_the_unperturbed_output(planted):
    batch, out, _, ref = planted
    tol = TOLERANCE["float16"]
    verdict = gate(out, ref, "float16", batch.seq_lens)
    assert verdict.passed and verdict.failing == 0 and verdict.max_err <= tol, verdict.describe()
    assert "<= 2e-03; 0 of" in verdict.describe()
    got = validation.compare(out, ref, tol, batch.seq_lens)
    assert got["passed"] and got["reason"] == "" and got["max_row_head_err"] == verdict.max_err
    assert validate_cpu.errors(out, ref, tol, batch.seq_lens)["passed"]
    worst = assert_rows_close(torch.from_numpy(out), torch.from_numpy(ref), "float16")
    assert worst == pytest.approx(verdict.max_err, rel=1e-9)


# -- the gate's edges ----------------------------------------------------------------------------

def test_row_head_errors_edges():
    ref = np.ones((2, 3, 4))
    ref[1, 2] = 0.0
    out = ref.copy()
    errors = row_head_errors(out, ref)
    assert errors.dtype == np.float64 and errors.shape == (2, 3) and (errors == 0).all()   # zero ref, zero out: 0
    out[0, 1, 2] = np.nan
    out[1, 0, 0] = np.inf
    out[1, 2, 3] = 1e-6                                                                  # zero ref, nonzero out
    errors = row_head_errors(out, ref)
    assert errors[0, 1] == math.inf and errors[1, 0] == math.inf and errors[1, 2] > 1e200
    assert errors[0, 0] == errors[0, 2] == errors[1, 1] == 0.0
    verdict = gate(out, ref, 1e-3)
    assert (verdict.worst_row, verdict.worst_head, verdict.failing) == (0, 1, 3)
    assert verdict.describe() == "row 0 head 1: rel err inf > 1e-03; 3 of 6 (row, head) over"
    np.testing.assert_array_equal(row_head_errors_torch(torch.from_numpy(out), torch.from_numpy(ref)).numpy(), errors)


def test_gate_refuses_what_it_cannot_judge():
    with pytest.raises(PKVError, match="must be \\[B, Hq, D\\]"):
        row_head_errors(np.ones((2, 3)), np.ones((2, 3)))
    with pytest.raises(PKVError, match="they must match"):
        row_head_errors(np.ones((2, 3, 4)), np.ones((2, 3, 5)))
    with pytest.raises(PKVError, match="a reference must be finite"):
        row_head_errors(np.ones((1, 1, 2)), np.array([[[1.0, np.nan]]]))
    with pytest.raises(PKVError, match="no tolerance for dtype 'int8'"):
        tolerance("int8")
    with pytest.raises(PKVError, match="positive finite number"):
        tolerance(0.0)
    assert tolerance("bfloat16") == 1e-2 and tolerance(3e-4) == 3e-4
    empty = gate_errors(np.zeros((0, 4)), "float16")
    assert empty.passed and empty.worst_row == -1 and empty.describe().startswith("no (row, head) to judge")
