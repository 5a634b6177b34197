"""The development benches' CPU-side parts: case parsing, the variants of bench_engine.py, the
comparison and paired-ratio tables, the atomic incremental result file that keeps finished cases
when a run dies half-way, host_overhead's loops, and summarize_dev's reading of benchmarks/runs/."""

from __future__ import annotations

import re
import sys
import time
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_write_rows_rewrites_one_file_per_run(tmp_path):
    t_start = time.time()
    first = bench_common.write_rows([{"case": "B=1 N=1024", "time_us": 7.0}], str(tmp_path), "bench_x", t_start,
                                    final=False)
    rows = [{"case": "B=1 N=1024", "time_us": 7.0}, {"case": "B=1 N=4096", "time_us": 12.0}]
    second = bench_common.write_rows(rows, str(tmp_path), "bench_x", t_start)
    assert first == second and list(tmp_path.iterdir()) == [first]
    assert pd.read_parquet(second)["time_us"].tolist() == [7.0, 12.0]


def test_write_rows_never_writes_in_place(tmp_path, monkeypatch):
    """An incremental save that dies mid-write (a time limit, a full disk) leaves the rows of the
    last complete save under the final name, and no temporary file beside it."""
    t_start = time.time()
    path = bench_common.write_rows([{"case": "B=1 N=1024", "time_us": 7.0}], str(tmp_path), "bench_x", t_start)

    def dies_half_way(self, target, **kwargs):
        Path(target).write_bytes(b"PAR1 half a file")
        raise OSError("no space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", dies_half_way)
    with pytest.raises(OSError, match="no space"):
        bench_common.write_rows([{"case": "B=1 N=1024", "time_us": 7.0}, {"case": "B=1 N=4096", "time_us": 12.0}],
                                str(tmp_path), "bench_x", t_start)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == [path] and pd.read_parquet(path)["time_us"].tolist() == [7.0]


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
    med = {"wq": 10.0, "wq8": 9.0, "split8": 7.0, "trtllm-xqa": 13.0, "vllm-fa3": 12.5, "flashinfer-tc": 11.0,
           "read": 1.0}
    ok = {n: t for n, t in med.items() if n not in ("split8", "flashinfer-tc")}  # both failed their float64 check
    errors = {"split8": 0.3, "flashinfer-tc": 5.4e-2, "trtllm-xqa": 1e-4, "vllm-fa3": 2e-4, "wq": 1e-4, "wq8": 1e-4}
    row = bench_common.comparison_row("B=1 N=4096", 3.9, med, ok, errors)
    assert row[3:5] == (("vllm-fa3", 12.5), ("wq8", 9.0))  # read is never ours
    assert row[5] == [("flashinfer-tc", 11.0, 5.4e-2)]  # a baseline that missed: shown, never the best
    bench_common.print_comparison([row])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "vllm-fa3=12.5" in line and "wq8=9.0" in line and "1.39x" in line and "43%" in line
    assert "read=1.0" in line and "trtllm-xqa" not in line  # every variant of ours is shown, no passing baseline
    assert "[outside the tolerance: flashinfer-tc=11.0 (err 5.4e-02), 1.22x]" in line


def test_every_shipped_route_and_warps_has_a_variant_name():
    from persistentkv.names import ENGINE_ROUTES

    assert tuple(bench_common.ROUTE_STEMS) == ENGINE_ROUTES
    assert bench_common.SHIPPED == ("wq", "wq8", "buckets", "buckets8", "split", "split8", "auto")
    assert len(set(bench_common.SHIPPED)) == len(bench_common.SHIPPED)


class FakeEngine:
    """Records what a bench asks of an engine: plan(batch, route, **options), run(q, kv, plan, out)."""

    def __init__(self, calls=None, target_items=264, **options):
        self.calls = [] if calls is None else calls
        self.target_items, self.options = target_items, options

    def plan(self, batch, route="workqueue", **options):
        if route not in ("workqueue", "buckets", "split"):
            raise ValueError(f"unknown route {route!r}")
        self.calls.append(("plan", batch, route, options))
        return ("plan-of", batch, route)

    def run(self, q, kv, plan, out):
        self.calls.append(("run", q, kv, plan, out))


def test_add_engine_plan_registers_the_plan_and_its_run_or_says_why_not(capsys):
    calls = []
    engine = FakeEngine(calls)
    runs = {}
    add = bench_common.planning_adder(runs)
    bench_common.add_engine_plan(add, "batch", "wq@x2", engine, {"route": "workqueue", "target_items": 528})
    bench_common.add_engine_plan(add, "batch", "nope", engine, {"route": "cluster"})
    assert calls == [("plan", "batch", "workqueue", {"target_items": 528})] and list(runs) == ["wq@x2"]
    assert "nope: not planned (ValueError: unknown route 'cluster')" in capsys.readouterr().out
    plan, make_run = runs["wq@x2"]
    make_run("q")("kv", plan, "out")
    assert calls[-1] == ("run", "q", "kv", ("plan-of", "batch", "workqueue"), "out")


def test_bench_engine_variants_are_the_shipped_routes_and_warps_then_waves(capsys):
    """One function builds every variant of ours as (name, engine, plan options), each engine from
    make_engine, so the same variants can come from another build of the kernels; warps whose
    engine cannot be built are left out with the reason."""
    import bench_engine

    built = []

    def make_engine(spec, **options):
        built.append(options)
        if options["warps"] == 8 and options.get("fail"):
            raise RuntimeError("no 8-warp module here")
        return FakeEngine(target_items=132 if options["warps"] == 8 else 264, **options)

    out = bench_engine.variants("spec", waves=(2, 0.5), make_engine=make_engine, make_auto=lambda: "the auto")
    assert [v.name for v in out] == ["wq", "buckets", "split", "wq@x2", "wq@x0.5",
                                     "wq8", "buckets8", "split8", "wq8@x2", "wq8@x0.5", "auto"]
    assert out[-1].engine == "the auto" and out[-1].plan == {}
    plans = {v.name: v.plan for v in out}
    assert plans["buckets8"] == {"route": "buckets"} and plans["wq"] == {"route": "workqueue"}
    assert plans["wq@x2"] == {"route": "workqueue", "target_items": 528}
    assert plans["wq8@x0.5"] == {"route": "workqueue", "target_items": 66}
    engines = {v.name: v.engine.options for v in out[:-1]}
    assert engines["wq8"] == engines["split8"] == {"warps": 8}
    assert built == [{"warps": 4}, {"warps": 8}]
    # an engine that cannot be built leaves its warps out, and says why
    out = bench_engine.variants("spec", make_engine=lambda spec, **o: (
        FakeEngine(**o) if o["warps"] == 4 else make_engine(spec, fail=True, **o)), make_auto=False)
    assert [v.name for v in out] == ["wq", "buckets", "split"]
    assert "8 warps: no engine (RuntimeError: no 8-warp module here)" in capsys.readouterr().out


def test_bench_engine_ctas_variants_and_the_default_auto(capsys):
    """--ctas K adds wqcK, the 4-warp module built for K CTAs per SM (left out with the reason where
    it cannot be built); auto is pkv-workqueue's own per-step choice, with the workqueue route only."""
    import bench_engine

    from persistentkv.backends.pkv import PKVWorkqueue

    def make_engine(spec, **options):
        if options.get("ctas_per_sm") == 4:
            raise RuntimeError("holds 3 CTAs per SM")
        return FakeEngine(**options)

    out = bench_engine.variants("spec", warps=(4,), routes=("workqueue",), ctas=(3, 4), make_engine=make_engine)
    assert [v.name for v in out] == ["wq", "wqc3", "auto"]
    assert out[1].engine.options == {"ctas_per_sm": 3} and out[1].plan == {"route": "workqueue"}
    assert isinstance(out[2].engine, bench_engine._Auto) and isinstance(out[2].engine._backend, PKVWorkqueue)
    assert "4 CTAs per SM: no engine (RuntimeError: holds 3 CTAs per SM)" in capsys.readouterr().out
    assert [v.name for v in bench_engine.variants("spec", warps=(4,), routes=("buckets",), make_engine=make_engine)] \
        == ["buckets"]


def test_bench_engine_auto_plans_through_the_backend_and_names_its_module():
    import bench_engine

    class Backend:
        def plan(self, batch):
            engine = SimpleNamespace(warps=4, ctas_per_sm=3, target_items=396,
                                     run=lambda q, kv, plan, out: calls.append((q, kv, plan, out)))
            return SimpleNamespace(engine=engine, batch=batch)

    calls = []
    auto = bench_engine._Auto(Backend(), rebuild=lambda batch: ("theirs", batch))
    plan = auto.plan("batch", route="workqueue")
    assert plan.batch == ("theirs", "batch") and auto.chosen == "4 warps, 3 CTAs per SM, 396 items"
    auto.run("q", "kv", plan, "out")
    assert calls == [("q", "kv", plan, "out")]


def test_bench_engine_against_builds_the_other_versions_variants_on_its_own_batches(tmp_path):
    """--against DIR imports DIR/src/persistentkv_TAG beside this version and names its shipped
    variants X-TAG; their plans get the batch rebuilt with that version's Batch and spec."""
    import bench_engine

    from persistentkv.cache import make_batch

    pkg = tmp_path / "src" / "persistentkv_old1"
    pkg.mkdir(parents=True)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "pkv_decode.cu").write_text("// another version\n")
    (pkg / "__init__.py").write_text("")
    (pkg / "spec.py").write_text("from collections import namedtuple\n"
                                 "AttentionSpec = namedtuple('AttentionSpec', 'num_qo_heads num_kv_heads head_dim "
                                 "page_size dtype')\n")
    (pkg / "cache.py").write_text("from collections import namedtuple\n"
                                  "Batch = namedtuple('Batch', 'spec seq_lens kv_indptr kv_indices num_pages')\n")
    (pkg / "engine.py").write_text(
        "class Engine:\n"
        "    def __init__(self, spec, warps=4):\n"
        "        self.spec, self.warps, self.target_items, self.min_chunk_tiles = spec, warps, 264, 2\n"
        "    def plan(self, batch, route='workqueue', **options):\n"
        "        return ('planned', type(batch).__module__, route, tuple(batch.seq_lens))\n"
        "def engine_for(spec, **options):\n"
        "    return Engine(spec, **options)\n")
    try:
        out = bench_engine.against_variants(str(tmp_path), bench_engine.SPEC)
    finally:
        sys.path.remove(str(tmp_path / "src"))
    assert [v.name for v in out] == ["wq-old1", "buckets-old1", "split-old1", "wq8-old1", "buckets8-old1",
                                     "split8-old1"]  # no backends.pkv there: no auto-old1
    assert [v.engine.warps for v in out] == [4, 4, 4, 8, 8, 8]
    try:  # --routes: only the queue
        queue_only = bench_engine.against_variants(str(tmp_path), bench_engine.SPEC, routes=("workqueue",))
    finally:
        sys.path.remove(str(tmp_path / "src"))
    assert [v.name for v in queue_only] == ["wq-old1", "wq8-old1"]
    batch = make_batch(bench_engine.SPEC, [300, 17])
    assert out[1].engine.plan(batch, **out[1].plan) == ("planned", "persistentkv_old1.cache", "buckets", (300, 17))
    (tmp_path / "kernels" / "pkv_decode.cu").unlink()
    with pytest.raises(SystemExit, match="must hold kernels/pkv_decode.cu"):
        bench_engine.against_variants(str(tmp_path), bench_engine.SPEC)


def test_bench_engine_options_are_checked_before_any_gpu_work():
    import bench_engine

    assert bench_engine.parse_waves("") == () and bench_engine.parse_waves("2, 0.5") == (2.0, 0.5)
    for bad in ("1", "0", "-2", "x", "nan"):
        with pytest.raises(SystemExit, match="--waves"):
            bench_engine.parse_waves(bad)
    assert bench_engine.parse_names("vllm-fa3,trtllm-xqa", ("vllm-fa3", "trtllm-xqa"), "--baselines") == \
        ("vllm-fa3", "trtllm-xqa")
    assert bench_engine.parse_names("", ("vllm-fa3",), "--baselines") == ()
    fp8 = bench_engine.replace(bench_engine.SPEC, kv_dtype="float8_e4m3")
    assert bench_engine.parse_ctas("", bench_engine.SPEC) == () and bench_engine.parse_ctas("3, 4", fp8) == (3, 4)
    for bad, spec, message in (("2", fp8, "--ctas: each must be one of 3, 4"),
                               ("x", fp8, "--ctas: 'x' is not comma-separated integers"),
                               ("3", bench_engine.SPEC, "--ctas needs --kv-dtype float8_e4m3")):
        with pytest.raises(SystemExit, match=re.escape(message)):
            bench_engine.parse_ctas(bad, spec)
    with pytest.raises(SystemExit, match="--baselines: flashinfer not among"):
        bench_engine.parse_names("vllm-fa3,flashinfer", ("vllm-fa3", "trtllm-xqa"), "--baselines")


def test_paired_ratios_pair_each_round_with_its_shipped_configuration():
    """Ratios are taken round by round (the variants of a round ran interleaved), only for a
    variant against its own shipped configuration: never a baseline whose name has a dash, a
    variant whose base is not shipped, one without its base, or a round that lacks either."""
    rng = np.random.default_rng(7)
    rows = []
    for case, scale in (("B=1 N=4096", 10.0), ("B=1 N=32768", 36.0)):
        for repeat in range(5):
            base = scale * (1 + 0.2 * rng.random())  # rounds differ by far more than the variants do
            times = {"wq8": base, "wq8-x": base * (0.95 if repeat != 2 else 1.02), "wq": base * 1.1,
                     "vllm-fa3": base * 1.2, "wq4-y": base, "read": base * 0.9, "read-z": base,
                     "split8": base * 1.3, "split8-against": base * 1.3 * 1.05}
            if case == "B=1 N=32768" and repeat == 4:
                del times["wq8"]  # a round without the base: left out
            rows += [{"case": case, "repeat": repeat, "variant": v, "time_us": t} for v, t in times.items()]
    table = bench_common.paired_ratios(pd.DataFrame(rows))
    assert set(table["variant"]) == {"wq8-x", "split8-against"} and set(table["base"]) == {"wq8", "split8"}
    assert table[table.variant == "split8-against"]["median"].tolist() == pytest.approx([1.05, 1.05])
    table = table[table.variant == "wq8-x"]
    first, second = table.itertuples()
    assert (first.case, first.rounds, first.faster) == ("B=1 N=4096", 5, 4)
    assert (second.case, second.rounds, second.faster) == ("B=1 N=32768", 4, 3)
    for r in (first, second):
        assert r.median == pytest.approx(0.95) and r.min == pytest.approx(0.95) and r.max == pytest.approx(1.02)
    assert bench_common.paired_ratios(pd.DataFrame(rows).query("variant not in ('wq8-x', 'split8-against')")).empty


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


def test_host_overhead_cpu_only_writes_its_rows_to_out(tmp_path):
    """--cpu-only (no GPU): the python_key rows of each loop length, written atomically to --out."""
    import host_overhead

    assert host_overhead.main(["--cpu-only", "--repeats", "2", "--out", str(tmp_path / "rows")]) == 0
    (path,) = (tmp_path / "rows").iterdir()
    df = pd.read_parquet(path)
    assert path.name.startswith("host_overhead_") and set(df["mode"]) == {"python_key"}
    assert sorted(df["loop_calls"]) == sorted(host_overhead.LOOPS) and (df["median_us"] > 0).all()


def test_summarize_dev_reads_every_committed_run(tmp_path, capsys):
    """Every file of benchmarks/runs/ is printed by one of summarize_dev's tables (the committed
    runs print without a GPU), and a file that no table reads is refused before anything prints."""
    import summarize_dev

    runs = sorted((ROOT / "benchmarks" / "runs").glob("*.parquet"))
    assert runs and all(summarize_dev.printer_for(p) for p in runs)
    assert summarize_dev.main() == 0
    out = capsys.readouterr().out
    assert all(f"\n{p.stem} (" in out for p in runs)
    assert re.search(r"B=1 N=4096\s+wq8-early_kv0\s+0\.941 ", out)  # a committed run's paired ratio, as printed
    (tmp_path / "bench_x.parquet").write_bytes((ROOT / "benchmarks" / "runs" / runs[0].name).read_bytes())
    (tmp_path / "stray.parquet").write_bytes(b"")
    with pytest.raises(SystemExit, match="stray.parquet: no table of summarize_dev.py reads it"):
        summarize_dev.main(tmp_path)
    assert capsys.readouterr().out == ""


def test_bench_engine_heads_set_the_spec_and_refuse_a_bad_pair():
    import bench_engine

    spec = bench_engine.parse_heads("4:1")
    assert (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim) == (4, 1, bench_engine.SPEC.head_dim)
    for bad in ("4", "4:x", "5:2"):
        with pytest.raises(SystemExit, match="--heads"):
            bench_engine.parse_heads(bad)



def test_sanitize_cases_checks_its_modules_before_any_gpu_work(capsys):
    """sanitize_cases.py: --warps 4/8, --ctas 3/4 only with an FP8 cache; a bad value is a usage
    error (exit 2) naming the option, before a CUDA call."""
    pytest.importorskip("torch")
    import sanitize_cases

    for argv, option in ((["--warps", "6"], "--warps takes 4 and/or 8"),
                         (["--ctas", "3"], "--ctas takes 3 and/or 4 with --kv-dtype float8_e4m3"),
                         (["--ctas", "5", "--kv-dtype", "float8_e4m3"], "--ctas takes 3 and/or 4"),
                         (["--ctas", "x", "--kv-dtype", "float8_e4m3"], "--ctas takes 3 and/or 4")):
        with pytest.raises(SystemExit) as exc:
            sanitize_cases.main(argv)
        assert exc.value.code == 2 and option in capsys.readouterr().err
