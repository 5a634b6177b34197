"""The development benches' CPU-side helpers (benchmarks/bench_common.py): case parsing and the
incremental result file that keeps finished cases when a run dies half-way."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_common  # noqa: E402


def test_write_rows_rewrites_one_file_per_run(tmp_path):
    t_start = time.time()
    first = bench_common.write_rows([{"case": "B=1 N=1024", "time_us": 7.0}], str(tmp_path), "bench_x", t_start,
                                    final=False)
    rows = [{"case": "B=1 N=1024", "time_us": 7.0}, {"case": "B=1 N=4096", "time_us": 12.0}]
    second = bench_common.write_rows(rows, str(tmp_path), "bench_x", t_start)
    assert first == second and list(tmp_path.iterdir()) == [first]
    assert pd.read_parquet(second)["time_us"].tolist() == [7.0, 12.0]


def test_write_rows_makes_a_missing_out_directory(tmp_path):
    """A bench given --out in a directory that does not exist yet keeps its rows (a session's
    replay_latency runs lost every one of their cases to this)."""
    out = tmp_path / "not" / "there"
    path = bench_common.write_rows([{"case": "B=1 N=4096", "time_us": 9.5}], str(out), "bench_x", time.time())
    assert path.parent == out and pd.read_parquet(path)["time_us"].tolist() == [9.5]


def test_bench_args_makes_out_or_refuses_it_before_any_work(tmp_path, monkeypatch, capsys):
    made = tmp_path / "a" / "b"
    monkeypatch.setattr(sys, "argv", ["bench", "--out", str(made), "--warm"])
    args = bench_common.bench_args()
    assert made.is_dir() and args.warm is True
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setattr(sys, "argv", ["bench", "--out", str(blocker / "sub")])
    with pytest.raises(SystemExit) as exc:
        bench_common.bench_args()
    assert exc.value.code == 2 and f"--out {blocker / 'sub'}" in capsys.readouterr().err


def test_parse_cases():
    assert bench_common.parse_cases("") == [(f"B={B} N={N}", [N] * B) for B, N in bench_common.CASES]
    assert bench_common.parse_cases("1x4096, B=4x8192") == [("B=1 N=4096", [4096]), ("B=4 N=8192", [8192] * 4)]
    assert bench_common.parse_cases("19392:13184:14128") == [("B=3 N=13184-19392", [19392, 13184, 14128])]
    (label, lengths), = bench_common.parse_cases("B8-bimodal")
    assert label == "B8-bimodal" and len(lengths) == 8 and len(set(lengths)) > 1   # a ragged row set
    for bad in ("4096", "1x", "0x4096", "2x4096x3", "B8-bimodl"):
        with pytest.raises(SystemExit, match="not BxN"):
            bench_common.parse_cases(bad)
    for bad in ("13184:0", "13184:x", "13184:"):
        with pytest.raises(SystemExit, match="not row lengths"):
            bench_common.parse_cases(bad)


def test_comparison_row_picks_the_fastest_checked_variant_of_each_kind(capsys):
    med = {"wq": 10.0, "wq8": 9.0, "pages4": 8.0, "pages5": 7.0, "trtllm-xqa": 13.0, "vllm-fa3": 12.5, "read": 1.0}
    ok = {n: t for n, t in med.items() if n != "pages5"}  # pages5 failed its float64 check
    row = bench_common.comparison_row("B=1 N=4096", 3.9, med, ok, lambda n: n.startswith("pages"))
    assert row[3:] == (("vllm-fa3", 12.5), ("wq8", 9.0), ("pages4", 8.0))  # read is never a candidate
    bench_common.print_comparison([row], "pages")
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "1.12x" in line and "1.56x" in line and "49%" in line


def test_add_queue_registers_the_engines_workqueue_plan_and_its_run():
    calls = []

    class FakeEngine:
        def plan(self, batch, route, **options):
            calls.append(("plan", batch, route, options))
            return ("plan-of", batch)

        def run(self, q, kv, plan, out):
            calls.append(("run", q, kv, plan, out))

    runs = {}
    add = bench_common.planning_adder(runs)
    engine = FakeEngine()
    bench_common.add_queue(add, "batch", "wq", engine)
    bench_common.add_queue(add, "batch", "wq-closed", engine, chunk_rule="closed")
    assert calls == [("plan", "batch", "workqueue", {}), ("plan", "batch", "workqueue", {"chunk_rule": "closed"})]
    plan, make_run = runs["wq-closed"]
    assert plan == ("plan-of", "batch")
    make_run("q")("kv", plan, "out")
    assert calls[-1] == ("run", "q", "kv", ("plan-of", "batch"), "out")


def test_adaptive_cold_runs_on_the_cpu_and_prints_each_trial(capsys):
    """benchmarks/adaptive_cold.py needs no GPU: one short trial prints the delegate's step time
    and the wrapper's and the adaptive's overhead over it."""
    import adaptive_cold

    policy = Path(__file__).resolve().parents[1] / "results" / "nvidia-h200" / "policy.json"
    assert adaptive_cold.main(["--policy", str(policy), "--trials", "1", "--rounds", "5"]) == 0
    out = capsys.readouterr().out
    assert "B=1 x 8200" in out and "trial 0: delegate" in out and "wrapper +" in out and "adaptive +" in out


def test_replay_latency_engine_options_parse_and_reach_engine_for(monkeypatch):
    import replay_latency

    from persistentkv import engine

    assert replay_latency.engine_options("early_kv=0,pdl=1") == {"early_kv": False, "pdl": True}
    for bad in ("early_kv=yes", "warps=8", "pdl"):
        with pytest.raises(SystemExit, match="--engine-options"):
            replay_latency.engine_options(bad)
    seen = []
    monkeypatch.setattr(engine, "engine_for", lambda spec, **options: seen.append((spec, options)))
    replay_latency.engine_with({"early_kv": False})
    engine.engine_for("spec", warps=8)  # as pkv-workqueue asks for its 8-warp module
    assert seen == [("spec", {"early_kv": False, "warps": 8})]


def test_paired_ratios_pair_each_round_with_its_shipped_queue():
    """Ratios are taken round by round (the variants of a round ran interleaved), only for a
    development variant against its own shipped queue: never a baseline whose name has a dash, a
    variant without its base, or a round that lacks either of the two."""
    rng = np.random.default_rng(7)
    rows = []
    for case, scale in (("B=1 N=4096", 10.0), ("B=1 N=32768", 36.0)):
        for repeat in range(5):
            base = scale * (1 + 0.2 * rng.random())  # rounds differ by far more than the variants do
            times = {"wq8": base, "wq8-x": base * (0.95 if repeat != 2 else 1.02), "wq": base * 1.1,
                     "vllm-fa3": base * 1.2, "wq4-y": base, "read": base * 0.9}
            if case == "B=1 N=32768" and repeat == 4:
                del times["wq8"]  # a round without the base: left out
            rows += [{"case": case, "repeat": repeat, "variant": v, "time_us": t} for v, t in times.items()]
    table = bench_common.paired_ratios(pd.DataFrame(rows))
    assert set(table["variant"]) == {"wq8-x"} and set(table["base"]) == {"wq8"}
    first, second = table.itertuples()
    assert (first.case, first.rounds, first.faster) == ("B=1 N=4096", 5, 4)
    assert (second.case, second.rounds, second.faster) == ("B=1 N=32768", 4, 3)
    for r in (first, second):
        assert r.median == pytest.approx(0.95) and r.min == pytest.approx(0.95) and r.max == pytest.approx(1.02)
    assert bench_common.paired_ratios(pd.DataFrame(rows).query("variant != 'wq8-x'")).empty


def test_host_overhead_loops_time_each_call_and_summarise_the_longest(monkeypatch):
    """benchmarks/host_overhead: each loop runs before() then sync() untimed, then its N calls with
    a stamp after each; summarise gives the loops' median mean per call, quartiles and the median
    of each loop's longest call."""
    import host_overhead

    events, now = [], [0.0]

    def call(i):  # call i of a loop takes i + 1 us; before() and sync() take 100 us, untimed
        events.append(("call", i))
        now[0] += i + 1

    def untimed(name):
        events.append(name)
        now[0] += 100

    from persistentkv.measure import protocols

    monkeypatch.setattr(protocols.time, "perf_counter", lambda: now[0] * 1e-6)  # the clock timed_calls reads
    samples = host_overhead.time_loops(call, lambda: untimed("sync"), repeats=2, loops=(2, 3),
                                       before=lambda: untimed("before"))
    one_round = ["before", "sync", ("call", 0), ("call", 1), "before", "sync", ("call", 0), ("call", 1), ("call", 2)]
    assert events == one_round * 2 + ["sync"]
    assert {n: [tuple(round(x, 6) for x in pair) for pair in pairs] for n, pairs in samples.items()} == {
        2: [(1.5, 2.0)] * 2, 3: [(2.0, 3.0)] * 2}  # (mean per call, longest call)
    rows = host_overhead.summarise({8: [(10.0, 50.0), (12.0, 70.0), (11.0, 60.0), (30.0, 200.0)]}, case="c", mode="m")
    (row,) = rows
    assert row["median_us"] == 11.5 and row["min_us"] == 10.0 and row["max_call_us"] == 65.0
    assert row["q1_us"] <= 11.5 <= row["q3_us"] and row["repeats"] == 4 and row["loop_calls"] == 8


def test_host_overhead_per_cpu_pins_each_cpu_in_turn_and_restores_the_affinity(monkeypatch):
    """--per-cpu: every pass times the call on each CPU (pinned while its loops run) and once
    unpinned, and the thread's affinity is the whole set again afterwards, also when a call fails."""
    import host_overhead

    assert host_overhead.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert host_overhead.parse_cpulist("") == set()
    cpus = {0, 1, 2}
    affinity = [set(cpus)]
    monkeypatch.setattr(host_overhead.os, "sched_getaffinity", lambda pid: set(affinity[-1]) if pid == 0 else None)
    monkeypatch.setattr(host_overhead.os, "sched_setaffinity", lambda pid, s: affinity.append(set(s)))
    monkeypatch.setattr(host_overhead, "cpu_topology", lambda: {c: (c // 2, f"{c // 2 * 2}-{c // 2 * 2 + 1}") for c in cpus})
    monkeypatch.setattr(host_overhead, "irq_counts", lambda: [0, 0, 0])
    seen = []
    rows = host_overhead.per_cpu_rows(lambda i: seen.append(frozenset(affinity[-1])), lambda: None, passes=2,
                                      repeats=3, local={1, 2}, probe=lambda: 5.0 + min(affinity[-1]))
    assert len(rows) == 2 * (len(cpus) + 1)
    for p in range(2):
        pinned = [r for r in rows if r["pass_"] == p and r["mode"] == "run_pinned"]
        assert sorted(r["cpu"] for r in pinned) == sorted(cpus)
        assert [r["cpu"] for r in rows if r["pass_"] == p and r["mode"] == "run_unpinned"] == [-1]
        assert {r["cpu"]: r["gpu_local"] for r in pinned} == {0: False, 1: True, 2: True}
        assert {r["cpu"]: r["core_id"] for r in pinned} == {0: 0, 1: 0, 2: 1}
        assert {r["cpu"]: r["probe_us"] for r in pinned} == {0: 5.0, 1: 6.0, 2: 7.0}  # probed on that CPU
    assert all(r["repeats"] == 3 and r["loop_calls"] == 8 for r in rows)
    # every call ran pinned to one CPU or on the whole set; 3 cpus + unpinned, 32 warm + 3 x 8 timed each
    assert set(seen) == {frozenset({c}) for c in cpus} | {frozenset(cpus)} and len(seen) == 2 * 4 * (32 + 24)
    assert affinity[-1] == cpus

    def failing(i):
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError):
        host_overhead.per_cpu_rows(failing, lambda: None, passes=1, repeats=1, local=set(), probe=lambda: 1.0)
    assert affinity[-1] == cpus


def test_bench_defines_head_split_plans_virtual_heads_that_compute_the_real_attention():
    """heads=N: PKV_HEADSPLIT=N built in; the queue planned for Hkv * N virtual kv heads. Item head h'
    reads K/V of kv head h' // N (the define) for query heads [h' G/N, (h' + 1) G/N), which is
    the real attention: executed on the CPU over a cache whose virtual head h' is kv head h' // N,
    the plan gives the float64 reference of the real spec. At B=4 x 8K the 8-warp queue's 132
    slots hold every virtual group's 8K tokens in one item, so nothing merges."""
    import bench_defines
    from persistentkv.cache import make_batch, random_cache
    from persistentkv.plan import plan_workqueue, unpack_items
    from persistentkv.reference import execute_plan, reference_decode
    from persistentkv.spec import AttentionSpec

    assert bench_defines.variant_build("heads=4") == (("PKV_HEADSPLIT=4",), {"heads": 4})
    assert bench_defines.variant_build("heads=2+early_kv=0") == (("PKV_HEADSPLIT=2",), {"heads": 2, "early_kv": False})
    for bad in ("heads=3", "heads=0", "PKV_HEADSPLIT=4"):
        with pytest.raises(ValueError):
            bench_defines.variant_build(bad)
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    vspec = bench_defines.head_split_spec(spec, 4)
    assert (vspec.num_qo_heads, vspec.num_kv_heads, vspec.group_size) == (32, 32, 1)
    with pytest.raises(ValueError, match="does not divide"):
        bench_defines.head_split_spec(spec, 8)

    rng = np.random.default_rng(7)
    small = AttentionSpec(8, 2, 64, 16, "float16")  # G = 4
    batch = make_batch(small, [37, 16, 129], hole_fraction=0.3, seed=int(rng.integers(1 << 30)))
    k, v = random_cache(small, batch.num_pages, seed=int(rng.integers(1 << 30)))
    q = rng.standard_normal((batch.batch_size, small.num_qo_heads, small.head_dim))
    ref = reference_decode(q, k.astype(np.float64), v.astype(np.float64), batch)
    for heads in (2, 4):
        vs = bench_defines.head_split_spec(small, heads)
        vbatch = bench_defines.head_split_batch(batch, vs)
        plan = plan_workqueue(vbatch, target_items=8)
        as_kernel_reads = np.repeat(k.astype(np.float64), heads, axis=2), np.repeat(v.astype(np.float64), heads, axis=2)
        out = execute_plan(plan, q, *as_kernel_reads, vbatch)  # virtual head h' = kv head h' // heads
        assert np.abs(out - ref).max() < 1e-12
        items = unpack_items(plan.items)
        assert set(items["head"][:plan.num_items].tolist()) == set(range(small.num_kv_heads * heads))

    wide = bench_defines.head_split_batch(make_batch(spec, [8192] * 4), vspec)
    plan = plan_workqueue(wide, target_items=132)
    assert plan.num_items == 4 * 32 and len(plan.merge_groups) == 0


def test_bench_defines_parses_defines_switches_and_pool_shares():
    import bench_defines

    assert bench_defines.variant_build("PKV_POOL=1+PKV_POOL_NOPROLOGUE=1+pool=2") == (
        ("PKV_POOL=1", "PKV_POOL_NOPROLOGUE=1"), {"pool": 0.125})
    assert bench_defines.variant_build("early_kv=0") == ((), {"early_kv": False})
    for bad in ("pool=0", "pool=16", "pool=x", "early_kv=2", "warps=8"):
        with pytest.raises(ValueError, match="pool=U"):
            bench_defines.variant_build(bad)
    assert bench_defines.variant_tag("pool=2") == "pool2"
