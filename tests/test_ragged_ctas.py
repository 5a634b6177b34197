"""benchmarks/ragged_ctas.py: the ragged-step CTA rule under test moves only steps auto runs on the
8-warp module, its case list is what bench_engine parses, and its reader pairs rounds correctly."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from persistentkv.choose import choose_ctas_per_sm, choose_warps, queue_imbalance
from persistentkv.plan import num_tiles

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ragged_ctas  # noqa: E402


def test_the_rule_moves_only_8_warp_steps_to_a_queue_half_as_unbalanced():
    moved = ragged_ctas.moved_steps(range(200, 400))
    assert len(moved) == 26  # the count the rule was fixed with (NOTES, item 2c)
    for _, seq, ctas in moved:
        assert choose_warps(seq, 128, num_kv_heads=8, queue4=ragged_ctas.QUEUE4, queue8=ragged_ctas.QUEUE8) == 8
        assert choose_ctas_per_sm(seq, 8, 132, ragged_ctas.QUEUE8) is None
        tiles = num_tiles(seq)
        assert ctas in (3, 4)
        base = queue_imbalance(tiles, 8, *ragged_ctas.QUEUE8)
        assert queue_imbalance(tiles, 8, ctas * 132, 2) <= 0.5 * base


def test_steps_the_shipped_rule_gives_more_ctas_keep_them():
    kept = 0
    for seed in range(0, 400):
        seq = ragged_ctas.ragged_step(seed)
        warps = choose_warps(seq, 128, num_kv_heads=8, queue4=ragged_ctas.QUEUE4, queue8=ragged_ctas.QUEUE8)
        queue = ragged_ctas.QUEUE4 if warps == 4 else ragged_ctas.QUEUE8
        if choose_ctas_per_sm(seq, 8, 132, queue) is not None:
            assert ragged_ctas.rule_ctas(seq) is None
            kept += 1
    assert kept > 0


def test_uniform_steps_are_not_moved():
    for batch, length in [(1, 131072), (4, 32768), (16, 8192), (64, 8192), (64, 256), (8, 512), (1, 32768)]:
        assert ragged_ctas.rule_ctas(np.full(batch, length)) is None


def test_cases_print_bench_engines_spelling(capsys):
    assert ragged_ctas.main(["cases", "--seeds", "200:400", "--limit", "3"]) == 0
    out = capsys.readouterr()
    cases = out.out.strip().split(",")
    assert len(cases) == 3
    for case, (_, seq, _) in zip(cases, ragged_ctas.moved_steps(range(200, 400))[:3]):
        assert [int(n) for n in case.split(":")] == seq.tolist()
    assert "CTAs" in out.err


def test_read_pairs_each_round_with_auto(tmp_path):
    _, seq, ctas = ragged_ctas.moved_steps(range(200, 400))[0]
    case = f"B={len(seq)} N={int(seq.min())}-{int(seq.max())}"
    auto = [100.0, 102.0, 98.0, 101.0]
    rule = [90.0, 103.0, 88.0, 95.0]  # per round 0.900, 1.010, 0.898, 0.941
    rows = [{"case": case, "batch_size": len(seq), "variant": v, "repeat": r, "time_us": t}
            for v, ts in (("auto", auto), (f"wqc{ctas}", rule), (f"wqc{7 - ctas}", auto)) for r, t in enumerate(ts)]
    rows += [{"case": "B=8 N=4096", "batch_size": 8, "variant": "auto", "repeat": 0, "time_us": 50.0}]
    path = tmp_path / "rows.parquet"
    pd.DataFrame(rows).to_parquet(path)
    first, uniform = ragged_ctas.read(str(path), range(200, 400))
    assert first["ctas"] == ctas and first["faster"] == 3 and first["rounds"] == 4
    assert abs(first["median"] - (90 / 100 + 95 / 101) / 2) < 1e-12
    assert abs(first["lo"] - 88 / 98) < 1e-12 and abs(first["hi"] - 103 / 102) < 1e-12
    assert uniform["ctas"] is None and "median" not in uniform


def test_bad_seeds_are_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        ragged_ctas.main(["cases", "--seeds", "x"])
    assert "--seeds takes first:last" in capsys.readouterr().err
