"""``persistentkv fp8-logits`` on the CPU: the config's tiny model, a float32 cache against FP8 caches.

The command's rows are checked for what they claim: one per (scales, step, row), the FP8 run
teacher-forced (every row's context grows by one a step from its prompt), errors that are real
(not zero, and larger when the FP8 cache is made worse on purpose: scales 1000x too small saturate
every code) and a top-1 agreement that an FP8 path reading the right values keeps.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from persistentkv import cli

torch = pytest.importorskip("torch", reason="the decode loop runs on torch")

from persistentkv.commands import fp8_logits  # noqa: E402

ARGS = ["--models", "tiny", "--rows", "3", "--prompt", "40", "--steps", "10", "--device", "cpu"]


def run(argv, capsys) -> tuple[int, str]:
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "fp8_logits.parquet"
    assert cli.main(["fp8-logits", "--out", str(out), *ARGS]) == 0
    return out, pd.read_parquet(out)


def test_one_row_per_scales_step_and_row_teacher_forced(measured):
    out, frame = measured
    assert list(frame.columns) == list(fp8_logits.COLUMNS)
    assert len(frame) == 2 * 10 * 3 and set(frame["scales"]) == set(fp8_logits.SCALES)
    assert set(frame["kv_dtype"]) == {"float8_e4m3"} and set(frame["dtype"]) == {"float32"}
    assert set(frame["backend"]) == {"torch-sdpa"} and set(frame["model"]) == {"tiny"}
    prompts = fp8_logits.prompt_lengths(3, 40)
    assert prompts == [40, 30, 22]
    want = [prompts[r] + s + 1 for r, s in zip(frame["row"], frame["step"])]
    assert frame["context"].tolist() == want
    (record,) = json.loads(out.with_suffix(".json").read_text()).values()
    assert record["config_hash"] and record["python"]


def test_the_errors_are_the_fp8_caches_and_small(measured):
    _, frame = measured
    for scales, part in frame.groupby("scales"):
        assert (part["rel_err"] > 0).all(), f"{scales}: a logit equal to the float32 run's: the FP8 cache is not read"
        assert part["rel_err"].max() < 0.25 and part["top1"].mean() >= 0.75, (scales, part["rel_err"].max())


def test_a_worse_fp8_cache_shows_as_a_larger_error(tmp_path, measured, monkeypatch):
    real = fp8_logits.fitted_scales
    monkeypatch.setattr(fp8_logits, "fitted_scales", lambda cache, per_head: real(cache, per_head) * 1e-3)
    out = tmp_path / "saturated.parquet"
    assert cli.main(["fp8-logits", "--out", str(out), *ARGS]) == 0
    saturated = pd.read_parquet(out)
    _, frame = measured
    for scales in fp8_logits.SCALES:
        good = frame.loc[frame["scales"] == scales, "rel_err"].median()
        bad = saturated.loc[saturated["scales"] == scales, "rel_err"].median()
        assert bad > 3 * good, (scales, good, bad)


def test_compare_logits_counts_what_it_says():
    ref = torch.tensor([[[1.0, 4.0, 2.0], [0.0, -2.0, 1.0]]])
    other = torch.tensor([[[1.0, 3.0, 3.5], [0.5, -2.0, 1.0]]])
    rel, top1 = fp8_logits.compare_logits(other, ref)
    assert rel.tolist() == [[pytest.approx(1.5 / 4.0), pytest.approx(0.5 / 2.0)]]
    assert top1.tolist() == [[False, True]]


@pytest.mark.parametrize("extra, expected", [
    (["--models", "nonesuch"], "--models: unknown nonesuch"),
    (["--steps", "0"], "--rows, --prompt and --steps must be >= 1"),
    (["--device", "tpu"], "--device must be cuda or cpu"),
    (["--backend", "nonesuch"], "--backend: unknown 'nonesuch'"),
])
def test_bad_input_is_one_line_before_any_work(tmp_path, capsys, extra, expected):
    code, err = run(["fp8-logits", "--out", tmp_path / "x.parquet", *ARGS, *extra], capsys)
    lines = [line for line in err.strip().splitlines() if line]
    assert code == 2 and len(lines) == 1 and expected in lines[0], err
    assert not list(tmp_path.iterdir())


def test_no_gpu_is_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    code, err = run(["fp8-logits", "--out", tmp_path / "x.parquet", "--models", "tiny", "--device", "cuda"], capsys)
    assert code == 2 and "torch sees no CUDA GPU" in err and len(err.strip().splitlines()) == 1


def test_prompt_lengths_are_ragged_and_never_empty():
    assert fp8_logits.prompt_lengths(5, 4) == [4, 3, 2, 1, 1]
    assert np.all(np.diff(fp8_logits.prompt_lengths(6, 2048)) < 0)
