"""The CPU side of benchmarks/trace_cta.py: its options, decoding the kernel's trace records
(kernels/pkv_decode.cu, PKV_TRACE) and the per-call timeline built from them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import trace_cta  # noqa: E402


def test_parse_args_takes_the_shipped_warps_and_routes_only(capsys):
    args = trace_cta.parse_args([])
    assert (args.warps, args.routes, args.calls) == ([4, 8], ["workqueue"], 10)
    args = trace_cta.parse_args(["--warps", "8", "--routes", "split, buckets", "--cases", "B8-bimodal"])
    assert (args.warps, args.routes) == ([8], ["split", "buckets"])
    for bad, says in ((["--warps", "6"], "--warps takes"), (["--warps", "x"], "--warps takes"),
                      (["--routes", "cluster"], "--routes takes"), (["--routes", "workqueue_host"], "--routes takes")):
        with pytest.raises(SystemExit):
            trace_cta.parse_args(bad)
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit, match="not BxN"):  # a bad case fails before any GPU work
        trace_cta.parse_args(["--cases", "4096"])


def record(ns, sm, block, slot, merged, tokens, cycles_per_ns=2):
    """One record as the kernel writes it: 7 ns stamps, 7 cycle stamps, 2 packed meta words."""
    rec = np.zeros(trace_cta.FIELDS, dtype=np.uint64)
    rec[:7] = ns
    rec[7:14] = [cycles_per_ns * t for t in ns]
    rec[14] = sm | (block << 16) | (slot << 40)
    rec[15] = merged | (tokens << 8)
    return rec


def synthetic(calls=3, items=2, period=10_000):
    """``calls`` calls of ``items`` CTAs: call k released at k * period ns; CTA i of it enters 500 ns
    before, lands its first stage 1000 + 100 i after release, ends its loop 6000 + 500 i after it,
    writes 300 later, decides 200 later; item 1 merges for 800 more, item 0 exits 100 later."""
    recs = []
    for k in range(calls):
        rel = k * period + 2_000
        for i in range(items):
            loop = rel + 6_000 + 500 * i
            decided = loop + 500
            exit_ = decided + (800 if i == 1 else 100)
            ns = [rel - 500, rel + 20 * i, rel + 1_000 + 100 * i, loop, loop + 300, decided, exit_]
            recs.append(record(ns, sm=3 + i, block=i, slot=7 + i, merged=int(i == 1), tokens=4096))
    return np.stack(recs)


def test_records_frame_decodes_the_packed_fields():
    df = trace_cta.records_frame(synthetic(), items=2, case="B=1 N=4096", warps=8)
    assert df.call.tolist() == [0, 0, 1, 1, 2, 2]
    assert df.block.tolist() == [0, 1] * 3 and df.sm.tolist() == [3, 4] * 3 and df.slot.tolist() == [7, 8] * 3
    assert df.merged.tolist() == [0, 1] * 3 and set(df.tokens) == {4096}
    assert (df.cyc_exit == 2 * df.ns_exit).all() and set(df.case) == {"B=1 N=4096"} and set(df.warps) == {8}


def test_call_table_measures_each_phase_from_the_release():
    df = trace_cta.records_frame(synthetic(calls=4), items=2, case="c", warps=8)
    stats = trace_cta.call_table(df, floor_us=3.0)
    # calls 1 and 2 have a predecessor and a successor; every call has the same shape
    assert stats["period"] == pytest.approx(10.0)
    assert stats["first"] == pytest.approx(1.05)               # median of 1000 and 1100 ns
    assert stats["loop"] == pytest.approx(6.5)                 # the last loop done, 6500 ns
    assert stats["tail"] == pytest.approx(0.5 + 0.8)           # decided 500 ns after it, merged 800 more
    assert stats["skew"] == pytest.approx(0.02)
    assert stats["loop_spread"] == pytest.approx(0.5)
    # the previous call's last exit: its item 1 at release + 6500 + 500 + 800 = release + 7800
    assert stats["gap"] == pytest.approx(10.0 - 7.8)
    assert stats["floor"] == 3.0


def test_last_cta_phases_split_the_tail_of_the_last_to_exit():
    df = trace_cta.records_frame(synthetic(calls=4), items=2, case="c", warps=8)
    # item 1 exits last: written 300 ns after its loop, decided 200 later, exits 800 after that
    assert trace_cta.last_cta_phases(df) == pytest.approx({"combine": 0.3, "arrive": 0.2, "merge": 0.8})
    assert trace_cta.last_cta_phases(df[df.call == 0]) == {}  # the first call alone: nothing to judge
