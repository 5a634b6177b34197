"""The measurement harness on the CPU: everything that is not a CUDA call.

Rotation (compact caches, cold-L2 copy counts, the copy walk across graphs), the interleaved
schedule, statistics, the raw-row schema against docs/DATA.md, the experiment grids from the real
config, the harness with fake backends on torch's CPU device (protocol bookkeeping, interleaving,
unavailable/failed/OOM rows, routes and counters), validation metrics and poison, provenance, the
ceiling kernel's compilation, and the GPU commands' one-line refusal without a GPU.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persistentkv import configuration
from persistentkv.backends.base import Capabilities
from persistentkv.cache import compact_batch, make_batch
from persistentkv.errors import PKVError
from persistentkv.names import PUBLISHED_TRACES
from persistentkv.measure import harness, rotation, schedule, statistics, workload
from persistentkv.measure.rows import (RAW_COLUMNS, VALIDATION_COLUMNS, one_line, raw_frame, raw_row,
                                       validation_frame)
from persistentkv.spec import AttentionSpec
from persistentkv.traces import build, sampled_steps, write_trace

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config" / "config.yaml"


# -- compact caches and rotation -------------------------------------------------------------------
def test_compact_batch_keeps_rows_order_and_scattering():
    spec = AttentionSpec(page_size=16)
    full = make_batch(spec, [100, 33, 500], hole_fraction=0.0, seed=4)
    compact, used = compact_batch(full, 0.0, seed=1)
    assert np.array_equal(used, np.unique(full.kv_indices))
    assert np.array_equal(compact.seq_lens, full.seq_lens) and np.array_equal(compact.kv_indptr, full.kv_indptr)
    n = full.kv_indices.size
    assert compact.num_pages == n and sorted(compact.kv_indices) == list(range(n))
    # relative physical order of the used pages is kept
    assert np.array_equal(np.argsort(compact.kv_indices, kind="stable"), np.argsort(full.kv_indices, kind="stable"))


def test_compact_batch_with_holes_spreads_pages_over_a_larger_universe():
    spec = AttentionSpec(page_size=16)
    full = make_batch(spec, [1000, 2000], hole_fraction=0.5, seed=2)
    compact, used = compact_batch(full, 0.5, seed=9)
    n = full.kv_indices.size
    assert np.array_equal(used, np.sort(full.kv_indices))
    assert compact.num_pages == math.ceil(n / 0.5)
    assert len(set(compact.kv_indices.tolist())) == n
    assert np.array_equal(np.argsort(compact.kv_indices), np.argsort(full.kv_indices))
    again, _ = compact_batch(full, 0.5, seed=9)
    assert np.array_equal(again.kv_indices, compact.kv_indices)


def test_compact_batch_shrinks_a_trace_step_to_its_pages():
    config = configuration.load_config(CONFIG)
    trace = build(configuration.trace_entry(config, "bimodal_b8"), 20260622, ROOT)
    spec = configuration.spec(config)
    cases = workload.trace_cases("t", trace, spec, 0.0, [0, 10], (), "bimodal_b8")
    for case in cases:
        assert case.batch.num_pages == case.batch.kv_indices.size  # only used pages
        assert rotation.cache_bytes(case.batch) >= case.batch.kv_bytes


def test_cold_copies_worked_number():
    # B=1 at 4096 tokens reads 16.8 MB; 3 x 60 MB of L2 -> 11 copies
    assert rotation.cold_copies(4096 * 4096, 60 * 10**6, 3) == 11
    assert rotation.cold_copies(10**10, 60 * 10**6, 3) == 1
    with pytest.raises(PKVError):
        rotation.cold_copies(0, 1, 3)


def test_graph_offsets_and_copies():
    assert rotation.graph_offsets(7) == list(range(7))
    assert rotation.graph_copies(10, 20, 10) == list(range(10, 20))
    assert rotation.graph_copies(5, 7, 10) == [5, 6, 0, 1, 2, 3, 4, 5, 6, 0]
    with pytest.raises(PKVError):
        rotation.graph_offsets(0)


@settings(max_examples=200, deadline=None)
@given(copies=st.integers(1, 60), calls=st.integers(1, 12), ops=st.lists(st.booleans(), min_size=1, max_size=60))
def test_copy_walk_rereads_a_copy_only_after_all_others(copies, calls, ops):
    """Whatever mix of graph replays and single calls, the reads are exactly the walk 0, 1, 2, ...
    mod R: a copy is read again only after the R - 1 others."""
    cursor = rotation.CopyCursor(copies, calls)
    reads = []
    for is_graph in ops:
        if is_graph:
            reads += rotation.graph_copies(cursor.offsets[cursor.next_graph()], copies, calls)
        else:
            reads.append(cursor.next_copy())
    assert reads == [i % copies for i in range(len(reads))]


# -- schedule ----------------------------------------------------------------------------------
def test_rounds_warmup_repeats_and_permutations():
    rs = schedule.rounds(4, repeats=5, warmup=3, seed=7, case_index=2)
    assert [r.repeat for r in rs] == [-1, -1, -1, 0, 1, 2, 3, 4]
    assert all(sorted(r.order) == [0, 1, 2, 3] for r in rs)
    assert len({r.order for r in rs}) > 1  # shuffled per round
    assert rs == schedule.rounds(4, repeats=5, warmup=3, seed=7, case_index=2)
    assert [r.order for r in rs] != [r.order for r in schedule.rounds(4, 5, 3, seed=8, case_index=2)]
    with pytest.raises(PKVError):
        schedule.rounds(3, repeats=0, warmup=0, seed=0)


# -- statistics --------------------------------------------------------------------------------
def test_statistics_worked_numbers():
    assert statistics.per_call_us(1.0, 10) == pytest.approx(100.0)
    assert statistics.gbps(134_217_728, 42.9) == pytest.approx(3128.6, rel=1e-3)
    assert statistics.frac_of_ceiling(134_217_728, 42.9, 4520) == pytest.approx(0.692, abs=1e-3)
    assert math.isnan(statistics.frac_of_ceiling(1, 1.0, math.nan))
    assert math.isnan(statistics.gbps(1, 0.0))
    assert statistics.median([3.0, math.nan, 1.0, 2.0]) == 2.0


def test_kernel_table_speedup_vs_best_baseline():
    import pandas as pd

    rows = [dict(trace="c1", backend=b, protocol="kernel", status="ok", time_us=t)
            for b, t in [("flashinfer-tc", 10.0), ("vllm-fa3", 8.0), ("pkv-workqueue", 4.0), ("pkv-buckets", 5.0),
                         ("torch-sdpa", 1.0)]]
    rows += [dict(trace="c1", backend="vllm-fa3", protocol="eager", status="ok", time_us=1.0)]
    table = statistics.kernel_table(pd.DataFrame(rows))
    assert table.loc["c1", "best_baseline"] == 8.0 and table.loc["c1", "best_pkv"] == 4.0
    assert table.loc["c1", "speedup"] == 2.0  # torch-sdpa is no baseline of the comparison


# -- rows against docs/DATA.md -------------------------------------------------------------------
def _doc_table_columns(section_title: str) -> list[str]:
    text = (ROOT / "docs" / "DATA.md").read_text()
    section = text.split(section_title, 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| column") and not line.startswith("|---"):
            names += [n.strip() for n in line.split("|")[1].split(",")]
    return names


def test_raw_columns_are_the_documented_ones_in_order():
    assert list(RAW_COLUMNS) == _doc_table_columns("## results/{hw}/raw/{experiment}.parquet")


def test_validation_columns_are_the_documented_ones():
    text = (ROOT / "docs" / "DATA.md").read_text()
    line = text.split("## results/{hw}/validation_gpu.parquet", 1)[1].split("\n\n", 2)[1]
    key = re.search(r"Per \(([^)]*)\)", line).group(1)
    documented = [n.strip() for n in key.split(",")] + re.findall(r"`([a-z][a-z0-9_]*)`", line.split(":", 1)[1])
    assert sorted(VALIDATION_COLUMNS) == sorted(documented)


def test_raw_row_defaults_and_checks():
    row = raw_row(backend="x", protocol="kernel", time_us=1.0)
    assert set(row) == set(RAW_COLUMNS) and math.isnan(row["wall_us"]) and row["num_splits"] == -1
    with pytest.raises(PKVError, match="unknown raw-row column"):
        raw_row(bogus=1)
    with pytest.raises(PKVError, match="needs a reason"):
        raw_row(status="failed")
    with pytest.raises(PKVError, match="column seed has missing values"):
        raw_frame([row])
    case = workload.synthetic_case("t", "c", [10], AttentionSpec(), ())
    from persistentkv.measure.rows import case_fields
    frame = raw_frame([raw_row(**case_fields(case), run_id="r", backend="x", route="x", protocol="kernel",
                               time_us=1.0)])
    assert list(frame.columns) == list(RAW_COLUMNS)
    assert str(frame["time_us"].dtype) == "float64" and str(frame["repeat"].dtype) == "int64"
    assert validation_frame([]).columns.tolist() == list(VALIDATION_COLUMNS)


def test_one_line_reasons():
    assert one_line(ValueError("bad\nthings\nhappened")) == "ValueError: bad"
    assert one_line("a   b\n c") == "a b c"
    assert len(one_line("x" * 1000)) == 300


# -- experiments from the real config ----------------------------------------------------------------
@pytest.fixture(scope="module")
def config():
    return configuration.load_config(CONFIG)


@pytest.fixture(scope="module")
def traces_dir(tmp_path_factory, config):
    folder = tmp_path_factory.mktemp("traces")
    seeds = [config["seeds"]["calibration"]] + list(config["seeds"]["holdout"])
    for entry in config["traces"]:
        for seed in seeds:
            write_trace(build(entry, seed, ROOT), workload.trace_path(folder, entry["name"], seed))
    return folder


def test_published_experiment_uses_holdout_seeds_and_the_stride(config, traces_dir):
    cases = workload.experiment_cases("published", config, traces_dir)
    assert {c.trace for c in cases} == set(PUBLISHED_TRACES)
    assert workload.seeds_of(cases) == sorted(config["seeds"]["holdout"])
    stride = config["measure"]["step_stride"]
    for (trace, seed) in {(c.trace, c.seed) for c in cases}:
        steps = [c.step for c in cases if c.trace == trace and c.seed == seed]
        full = workload.load_trace(traces_dir, trace, seed)
        assert steps == [full.steps[i].index for i in range(0, len(full.steps), stride)]
    names = [v.name for v in cases[0].variants]
    assert names == config["measure"]["backends"]
    bimodal = next(c for c in cases if c.trace == "bimodal_b8")
    assert dict(next(v for v in bimodal.variants if v.name == "pkv-buckets").options) == {"num_splits": 20}
    wq = next(v for v in bimodal.variants if v.name == "pkv-workqueue")
    assert wq.kwargs == {"target_items": config["planner"]["target_items"],
                         "min_chunk_tiles": config["planner"]["min_chunk_tiles"]}


def test_calibration_has_no_adaptive_and_adds_the_batch_sweep(config, traces_dir):
    cases = workload.experiment_cases("calibration", config, traces_dir)
    assert workload.seeds_of(cases) in ([config["seeds"]["calibration"]], [0, config["seeds"]["calibration"]])
    assert all([v.name for v in c.variants] == config["policy"]["candidates"] for c in cases)
    assert "adaptive" not in config["policy"]["candidates"]
    sweep = config["measure"]["batch_sweep"]
    synthetic = [c for c in cases if c.trace.startswith("B")]
    assert len(synthetic) == len(sweep["batch_sizes"]) * len(sweep["lengths"])
    assert {c.trace for c in cases} >= {t["name"] for t in config["traces"]}


def test_gqa_fragmented_long_context_and_split_sweep(config, traces_dir):
    gqa = workload.experiment_cases("gqa_sweep", config, traces_dir)
    hkv = config["spec"]["num_kv_heads"]
    assert sorted({c.spec.num_qo_heads for c in gqa}) == sorted(g * hkv for g in config["measure"]["gqa_sweep"]["group_sizes"])
    frag = workload.experiment_cases("fragmented", config, traces_dir)
    rho = config["measure"]["fragmented"]["hole_fraction"]
    assert all(c.hole_fraction == rho and c.batch.num_pages == math.ceil(c.batch.kv_indices.size / (1 - rho))
               for c in frag)
    lc = workload.experiment_cases("long_context", config, traces_dir)
    assert [c.batch.max_len for c in lc] == config["measure"]["long_context"]["lengths"]
    splits = workload.experiment_cases("split_sensitivity", config, traces_dir)
    values = config["ablations"]["splits"]["values"]
    for case in splits:
        got = sorted(v.num_splits for v in case.variants if v.name == "pkv-buckets")
        assert got == sorted(values)
        assert {v.name for v in case.variants} == {"pkv-buckets", "pkv-split"}
    assert {c.trace for c in splits} == set(workload.SPLIT_SENSITIVITY_TRACES)


def test_quick_is_smaller_and_unknown_names_are_one_line_errors(config, traces_dir):
    full = workload.experiment_cases("published", config, traces_dir)
    quick = workload.experiment_cases("published", config, traces_dir, quick=True)
    assert 0 < len(quick) < len(full) and workload.seeds_of(quick) == [config["seeds"]["holdout"][0]]
    with pytest.raises(PKVError, match="unknown experiment 'nope'"):
        workload.experiment_cases("nope", config, traces_dir)
    with pytest.raises(PKVError, match="does not exist"):
        workload.experiment_cases("published", config, traces_dir / "missing")


def test_bench_grid_and_sampled_steps(config, traces_dir):
    grid = workload.bench_grid()
    names = [n for n, _ in grid]
    assert len(names) == len(set(names)) == 6 * 6 + 4
    lengths = dict(grid)
    assert lengths["B8-ragged"][:3] == [65536] * 3 and len(lengths["B8-ragged"]) == 8
    assert lengths["B1xN262144"] == [262144]
    trace = workload.load_trace(traces_dir, "bimodal_b8", config["seeds"]["calibration"])
    picked = sampled_steps(trace, 4)
    heaviest = int(np.argmax([s.total_tokens for s in trace.steps]))
    assert len(picked) == 4 and 0 in picked and heaviest in picked and picked == sorted(set(picked))
    assert sampled_steps(trace, 4) == picked
    from persistentkv.measure import runner

    assert runner.sampled_steps is sampled_steps  # validate-gpu samples as validate-cpu does


# -- the harness with fake backends on the CPU ------------------------------------------------------
from persistentkv.measure.device import TorchDevice  # noqa: E402
from persistentkv.measure.harness import BackendFactory, RunContext, Settings, run_case  # noqa: E402

SPEC = AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")


class Log:
    def __init__(self):
        self.events = []


class FakeBackend:
    """Records every plan/run (with the copy it read) into a shared log; behaviour by options."""

    def __init__(self, name, log, role, reasons=(), fail=None, graph="device", counters=None, decision=None):
        self.name, self.log, self.role = name, log, role
        self.reasons, self.fail = list(reasons), fail
        self.capabilities = Capabilities(dtypes=("float32",), graph=graph)
        self._counters, self.last_decision = counters, decision

    def unavailable(self, spec):
        return self.reasons

    def plan(self, batch):
        self.log.events.append(("plan", self.name, self.role))
        if self.fail == "plan":
            raise RuntimeError("planner exploded\nsecond line")
        counters = self._counters

        class P:
            def counters(self_inner):
                return counters
        plan = P() if counters is not None else types.SimpleNamespace()
        if self.last_decision is not None:  # a delegating backend's plan names its delegate
            plan.route = self.last_decision.backend
        return plan

    def run(self, q, cache, plan, out):
        self.log.events.append(("run", self.name, self.role, cache[0].data_ptr()))
        if self.fail == "oom":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        if self.fail == "second-eager" and sum(1 for e in self.log.events if e[:2] == ("run", self.name)) > 3:
            raise RuntimeError("flaky")
        out.copy_(q)


class FakeDevice(TorchDevice):
    def __init__(self, l2_bytes, log=None):
        super().__init__("cpu", l2_bytes=l2_bytes)
        self.emptied = 0
        self.copies = None
        self.log = log

    def event(self):
        if self.log is None:
            return super().event()
        self.log.events.append(("event",))
        inner, log = super().event(), self.log

        class Logged:
            def record(self_inner):
                log.events.append(("record",))
                inner.record()

            def elapsed_ms(self_inner, end):
                return inner.elapsed_ms(end.inner)
        logged = Logged()
        logged.inner = inner
        return logged

    def queue_ahead(self, cycles):
        if self.log is not None:
            self.log.events.append(("queue", cycles))
        super().queue_ahead(cycles)

    def synchronize(self):
        if self.log is not None:
            self.log.events.append(("sync",))
        super().synchronize()

    def empty_cache(self):
        self.emptied += 1

    def make_copies(self, batch, copies, seed, source=None):
        self.copies = super().make_copies(batch, copies, seed, source)
        return self.copies


def make_factory(log, behaviours):
    def create(name, **options):
        return FakeBackend(name, log, role=None, **behaviours.get(name, {}))

    factory = BackendFactory(create)
    original = factory.get

    def get(variant, role="main"):
        backend = original(variant, role)
        backend.role = role
        return backend
    factory.get = get
    return factory


def case_with(names, lengths=(40, 17), experiment="t"):
    return workload.synthetic_case(experiment, "c", list(lengths), SPEC, tuple(workload.Variant(n) for n in names))


def copy_index(device, ptr):
    for i, k in enumerate(device.copies.k):
        if k.data_ptr() == ptr:
            return i
    raise AssertionError("run() read something that is not a cache copy")


def test_harness_rows_per_protocol_and_repeat():
    log = Log()
    device = FakeDevice(l2_bytes=200_000)
    case = case_with(["flashinfer-tc", "pkv-workqueue"])
    settings_ = Settings(layers=3, repeats=4, warmup=2, calls_per_graph=5)
    rows = run_case(case, device, make_factory(log, {}), settings_, RunContext("run1", 1000.0, log=lambda m: None))
    frame = raw_frame(rows)
    assert (frame["status"] == "ok").all() and len(frame) == 2 * 4 * 4
    for (backend, protocol), group in frame.groupby(["backend", "protocol"]):
        assert sorted(group["repeat"]) == [0, 1, 2, 3]
    step = frame[frame["protocol"] == "step"]
    assert (step["layers"] == 3).all() and np.allclose(step["per_layer_us"] * 3, step["time_us"])
    assert frame[frame["protocol"] == "eager"]["host_us"].notna().all()
    assert frame[frame["protocol"] == "published"]["wall_us"].notna().all()
    assert (frame["time_us"] > 0).all() and frame["frac_of_ceiling"].notna().all()
    assert (frame["run_id"] == "run1").all() and (frame["read_ceiling_gbps"] == 1000.0).all()
    assert (frame["kv_bytes"] == case.batch.kv_bytes).all()


def test_step_repeats_add_rounds_of_step_rows_only():
    log = Log()
    device = FakeDevice(l2_bytes=0)
    case = case_with(["flashinfer-tc", "pkv-workqueue"])
    settings_ = Settings(layers=2, repeats=3, warmup=1, calls_per_graph=2, step_repeats=7)
    assert settings_.rounds == 7 and settings_.repeats_of("step") == 7 and settings_.repeats_of("kernel") == 3
    rows = run_case(case, device, make_factory(log, {}), settings_, RunContext("r", log=lambda m: None))
    frame = raw_frame(rows)
    assert (frame["status"] == "ok").all()
    for (backend, protocol), group in frame.groupby(["backend", "protocol"]):
        assert sorted(group["repeat"]) == list(range(7 if protocol == "step" else 3)), (backend, protocol)
    # the extra rounds run step instances only: 1 warm-up + 7 recorded step plans per backend
    step_plans = [e for e in log.events if e[0] == "plan" and e[2] == "step"]
    assert len(step_plans) == 2 * (1 + 1 + 7)
    assert Settings(repeats=3, protocols=("kernel", "eager")).rounds == 3
    assert Settings(repeats=3, step_repeats=2).rounds == 3
    with pytest.raises(PKVError, match="step_repeats must be >= 1"):
        Settings(step_repeats=0)


def test_bench_repeats_apply_to_bench_kernels_settings_only(config):
    m = config["measure"]
    assert Settings.from_config(config, bench=True).repeats == m["bench_repeats"] != m["repeats"]
    assert Settings.from_config(config).repeats == m["repeats"]
    assert Settings.from_config(config, bench=True, quick=True).repeats == 2
    trimmed = {**config, "measure": {k: v for k, v in m.items() if k != "bench_repeats"}}
    assert Settings.from_config(trimmed, bench=True).repeats == m["repeats"]


def test_eager_loop_calls_come_from_the_config_with_a_default(config):
    m = config["measure"]
    assert Settings.from_config(config).eager_loop_calls == m["eager_loop_calls"] == 8
    zero = {**config, "measure": {**m, "eager_loop_calls": 0}}
    assert Settings.from_config(zero).eager_loop_calls == 0
    trimmed = {**config, "measure": {k: v for k, v in m.items() if k != "eager_loop_calls"}}
    assert Settings.from_config(trimmed).eager_loop_calls == Settings().eager_loop_calls


def test_step_repeats_come_from_config_and_quick_drops_them(config):
    assert Settings.from_config(config).step_repeats == config["measure"]["step_repeats"]
    assert Settings.from_config(config, quick=True).step_repeats is None
    trimmed = {**config, "measure": {k: v for k, v in config["measure"].items() if k != "step_repeats"}}
    assert Settings.from_config(trimmed).repeats_of("step") == config["measure"]["repeats"]


class FakeAffinity:
    """sched_getaffinity / sched_setaffinity of one thread, with a probe that reads as ``speed[cpu]``."""

    def __init__(self, cpus, speed):
        self.current, self.calls, self.speed = set(cpus), [], speed

    def get(self, pid):
        assert pid == 0
        return set(self.current)

    def set(self, pid, cpus):
        assert pid == 0
        self.current = set(cpus)
        self.calls.append(frozenset(cpus))

    def probe(self):
        (cpu,) = self.current  # the probe runs pinned to one CPU
        return self.speed[cpu]


def test_host_cpu_setting_is_checked_in_one_line(config):
    from persistentkv.measure.host_cpu import check_host_cpu

    assert check_host_cpu("fastest") == "fastest" and check_host_cpu("none") == "none"
    assert check_host_cpu(3) == 3 and check_host_cpu(" 5 ") == 5
    for bad in ("fast", -1, True, 2.5, None):
        with pytest.raises(PKVError, match="host_cpu"):
            check_host_cpu(bad)
    assert Settings.from_config(config).host_cpu == config["measure"]["host_cpu"] == "fastest"
    trimmed = {**config, "measure": {k: v for k, v in config["measure"].items() if k != "host_cpu"}}
    assert Settings.from_config(trimmed).host_cpu == "none"
    with pytest.raises(PKVError, match="host_cpu"):
        Settings.from_config({**config, "measure": {**config["measure"], "host_cpu": "quickest"}})


def test_host_pinner_picks_the_quickest_cpu_each_time_and_restores(monkeypatch):
    from persistentkv.measure import host_cpu
    from persistentkv.measure.host_cpu import HostPinner

    aff = FakeAffinity({0, 1, 2, 3}, {0: 10.5, 1: 6.7, 2: 6.9, 3: 10.1})
    pinner = HostPinner("fastest", log=lambda m: None, probe=aff.probe, get_affinity=aff.get, set_affinity=aff.set)
    assert pinner.pin() == (1, 6.7) and aff.current == {1}
    assert set(aff.calls[:4]) == {frozenset({c}) for c in range(4)}  # every CPU probed, pinned alone
    aff.speed.update({1: 11.0, 3: 6.6})  # the host's state moves: the next round goes elsewhere
    assert pinner.pin() == (3, 6.6) and aff.current == {3}
    pinner.restore()
    assert aff.current == {0, 1, 2, 3}

    fixed = HostPinner(2, log=lambda m: None, probe=aff.probe, get_affinity=aff.get, set_affinity=aff.set)
    assert fixed.pin() == (2, 6.9)
    fixed.restore()
    with pytest.raises(PKVError, match="may run on CPUs \\[0, 1, 2, 3\\] only"):
        HostPinner(7, log=lambda m: None, probe=aff.probe, get_affinity=aff.get, set_affinity=aff.set)

    none = HostPinner("none", probe=aff.probe, get_affinity=aff.get, set_affinity=aff.set)
    calls = len(aff.calls)
    pin = none.pin()
    assert pin[0] == -1 and math.isnan(pin[1]) and len(aff.calls) == calls  # nothing probed or pinned

    said = []
    monkeypatch.setattr(host_cpu, "os", types.SimpleNamespace())  # a platform without sched_setaffinity
    nowhere = HostPinner("fastest", log=said.append)
    pin = nowhere.pin()
    assert pin[0] == -1 and math.isnan(pin[1]) and "cannot pin a thread" in said[0]
    nowhere.restore()


def test_host_pinner_carries_on_unpinned_when_the_os_refuses():
    from persistentkv.measure.host_cpu import HostPinner

    aff = FakeAffinity({0, 1, 2}, {0: 7.0, 1: 6.0, 2: 9.0})
    said = []

    def refuse_cpu_2(pid, cpus):
        if cpus == {2}:
            raise OSError(22, "Invalid argument")
        aff.set(pid, cpus)

    pinner = HostPinner("fastest", log=said.append, probe=aff.probe, get_affinity=aff.get, set_affinity=refuse_cpu_2)
    cpu, probe = pinner.pin()
    assert cpu == -1 and math.isnan(probe) and "pinning failed" in said[0]
    assert aff.current == {0, 1, 2}  # restored before carrying on
    assert pinner.pin()[0] == -1 and len(said) == 1  # said once; later rounds are simply unpinned


def test_the_probe_times_its_workload_best_of_repeats():
    from persistentkv.measure.host_cpu import probe_us

    ticks = iter([0.0, 5e-6, 10e-6, 13e-6, 20e-6, 29e-6])  # three timings: 5, 3, 9 us
    assert probe_us(n=10, repeats=3, clock=lambda: next(ticks)) == pytest.approx(3.0)
    assert 0 < probe_us(n=100, repeats=2) < 1e6


def test_harness_rows_say_which_cpu_each_round_ran_on():
    from persistentkv.measure.host_cpu import HostPinner

    log = Log()
    device = FakeDevice(l2_bytes=0)
    case = case_with(["flashinfer-tc", "pkv-workqueue"])
    aff = FakeAffinity({0, 1}, {0: 7.0, 1: 9.0})
    rounds_seen = []

    def probe():
        rounds_seen.append(None)
        return aff.probe()

    pinner = HostPinner("fastest", log=lambda m: None, probe=probe, get_affinity=aff.get, set_affinity=aff.set)
    settings_ = Settings(layers=1, repeats=3, warmup=1, calls_per_graph=2, protocols=("eager", "kernel"))
    ctx = RunContext("r", log=lambda m: None, pinner=pinner)
    frame = raw_frame(run_case(case, device, make_factory(log, {}), settings_, ctx))
    assert (frame["status"] == "ok").all() and (frame["host_cpu"] == 0).all()
    assert (frame["host_probe_us"] == 7.0).all()
    assert len(rounds_seen) == 2 * (1 + 3)  # both CPUs probed before each of the 4 rounds (1 warm-up)
    unpinned = raw_frame(run_case(case, device, make_factory(log, {}), settings_, RunContext("r", log=lambda m: None)))
    assert (unpinned["host_cpu"] == -1).all() and unpinned["host_probe_us"].isna().all()


def test_run_cases_pins_from_the_settings_and_restores_the_affinity_after_a_failure(monkeypatch):
    from persistentkv.measure import harness

    aff = FakeAffinity({0, 1, 2}, {0: 9.0, 1: 9.0, 2: 6.0})
    made = []

    class Pinner(harness.HostPinner):
        def __init__(self, mode, log=print):
            made.append(mode)
            super().__init__(mode, log=log, probe=aff.probe, get_affinity=aff.get, set_affinity=aff.set)

    monkeypatch.setattr(harness, "HostPinner", Pinner)
    log = Log()
    device = FakeDevice(l2_bytes=0)
    settings_ = Settings(layers=1, repeats=2, warmup=0, calls_per_graph=2, protocols=("eager",), host_cpu="fastest")
    ctx = RunContext("r", log=lambda m: None)
    rows = harness.run_cases([case_with(["pkv-workqueue"])], device, make_factory(log, {}), settings_, ctx,
                             progress=False)
    assert made == ["fastest"] and {r["host_cpu"] for r in rows} == {2}
    assert aff.current == {0, 1, 2} and ctx.pinner is None

    def boom(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(harness, "run_case", boom)
    with pytest.raises(RuntimeError, match="device lost"):
        harness.run_cases([case_with(["pkv-workqueue"])], device, make_factory(log, {}), settings_, ctx, progress=False)
    assert aff.current == {0, 1, 2} and ctx.pinner is None


def test_harness_interleaves_every_backend_once_per_round():
    log = Log()
    device = FakeDevice(l2_bytes=0)
    case = case_with(["flashinfer-tc", "vllm-fa3", "trtllm-xqa"])
    settings_ = Settings(layers=1, repeats=3, warmup=1, calls_per_graph=2, protocols=("eager",), eager_loop_calls=0)
    run_case(case, device, make_factory(log, {}), settings_, RunContext("r", log=lambda m: None))
    eager_runs = [e[1] for e in log.events if e[0] == "run" and e[2] == "main"]
    timed = eager_runs[3:]  # after each backend's warm-up call
    rounds = [timed[i:i + 3] for i in range(0, len(timed), 3)]
    assert len(rounds) == 4 and all(sorted(r) == ["flashinfer-tc", "trtllm-xqa", "vllm-fa3"] for r in rounds)


def test_eager_rows_time_a_back_to_back_loop_after_the_single_call():
    """Each eager visit: the timed call between a synchronisation and its event, then
    eager_loop_calls calls back to back (no synchronisation between them, each on the next copy),
    then one synchronisation; host_loop_us is set on eager rows only."""
    log = Log()
    case_bytes = case_with(["a"]).batch.kv_bytes
    device = FakeDevice(l2_bytes=case_bytes * 4, log=log)  # 3 x L2 / case: 12 copies
    case = case_with(["pkv-workqueue"])
    settings_ = Settings(layers=2, repeats=2, warmup=1, calls_per_graph=2, protocols=("eager", "step"),
                         eager_loop_calls=3)
    rows = run_case(case, device, make_factory(log, {}), settings_, RunContext("r", log=lambda m: None))
    frame = raw_frame(rows)
    eager = frame[frame["protocol"] == "eager"]
    assert len(eager) == 2 and (eager["host_loop_us"] > 0).all() and (eager["host_us"] > 0).all()
    assert (eager["host_loop_max_us"] >= eager["host_loop_us"]).all()  # the longest call >= the mean
    assert (eager["host_loop_max_us"] <= 3 * eager["host_loop_us"] * (1 + 1e-9)).all()  # <= the 3 calls' sum
    assert frame[frame["protocol"] != "eager"][["host_loop_us", "host_loop_max_us"]].isna().all().all()
    # the event stream of one eager visit: sync, record, run, record, sync, run x 3, sync
    kinds = [e[0] for e in log.events if e[0] in ("sync", "record", "run", "plan")]
    visit = ["sync", "record", "run", "record", "sync", "run", "run", "run", "sync"]
    starts = [i for i in range(len(kinds)) if kinds[i:i + len(visit)] == visit]
    assert len(starts) == 3  # the warm-up round and the two recorded ones
    runs = [e for e in log.events if e[0] == "run"]
    main_runs = [copy_index(device, e[3]) for e in runs if e[2] == "main"]
    assert all(b == (a + 1) % len(device.copies) for a, b in zip(main_runs[-4:], main_runs[-3:]))
    with pytest.raises(PKVError, match="eager_loop_calls must be >= 0"):
        Settings(eager_loop_calls=-1)


def test_harness_walks_cold_copies_across_backends_and_graphs():
    log = Log()
    case_bytes = case_with(["a"]).batch.kv_bytes
    device = FakeDevice(l2_bytes=case_bytes * 2, log=log)  # 3 x L2 / case = 6 copies
    case = case_with(["flashinfer-tc", "vllm-fa3"])
    settings_ = Settings(layers=2, repeats=3, warmup=1, calls_per_graph=4, cold_l2_factor=3.0)
    run_case(case, device, make_factory(log, {}), settings_, RunContext("r", log=lambda m: None))
    R = len(device.copies)
    assert R == 6
    # after set-up (warm-ups, graph capture: no timing events yet), every timed read continues one
    # walk over the copies, across backends and protocols
    setup_end = next(i for i, e in enumerate(log.events) if e[0] == "event")
    reads = [copy_index(device, e[3]) for e in log.events[setup_end:] if e[0] == "run"]
    assert len(reads) > 3 * R
    assert reads == [(reads[0] + i) % R for i in range(len(reads))]


def test_kernel_rows_queue_each_replay_behind_the_spin_before_its_first_event():
    log = Log()
    device = FakeDevice(l2_bytes=0, log=log)
    case = case_with(["flashinfer-tc", "vllm-fa3"])
    settings_ = Settings(layers=1, repeats=3, warmup=1, calls_per_graph=2, protocols=("kernel",),
                         kernel_queue_cycles=12345)
    rows = run_case(case, device, make_factory(log, {}), settings_, RunContext("r", log=lambda m: None))
    assert len(rows) == 2 * 3 and all(r["status"] == "ok" for r in rows)
    timed = [e[0] for e in log.events[next(i for i, e in enumerate(log.events) if e[0] in ("queue", "event")):]
             if e[0] not in ("event", "sync")]
    # every window: the spin, then the start event, the graph's calls, the end event; warm-up rounds too
    windows = [timed[i:i + 5] for i in range(0, len(timed), 5)]
    assert len(windows) == 2 * (1 + 3)
    assert all(w == ["queue", "record", "run", "run", "record"] for w in windows), windows[:2]
    assert {e[1] for e in log.events if e[0] == "queue"} == {12345}
    with pytest.raises(PKVError, match="kernel_queue_cycles must be >= 0"):
        Settings(kernel_queue_cycles=-1)
    with pytest.raises(PKVError, match="cycles must be >= 0"):
        device.queue_ahead(-5)


def test_queue_ahead_spins_on_cuda_and_says_what_to_do_without_the_spin():
    from types import SimpleNamespace

    calls = []
    device = object.__new__(TorchDevice)
    device.is_cuda = True
    device.torch = SimpleNamespace(__version__="9.9", cuda=SimpleNamespace(_sleep=calls.append))
    device.queue_ahead(1000)
    device.queue_ahead(0)                       # 0: no spin at all
    assert calls == [1000]
    device.torch = SimpleNamespace(__version__="9.9", cuda=SimpleNamespace())
    with pytest.raises(PKVError, match="torch 9.9 has no torch.cuda._sleep.*kernel_queue_cycles: 0"):
        device.queue_ahead(1000)


def test_kernel_queue_cycles_come_from_config_and_default_to_off(config):
    assert Settings.from_config(config).kernel_queue_cycles == config["measure"]["kernel_queue_cycles"] > 0
    trimmed = {**config, "measure": {k: v for k, v in config["measure"].items() if k != "kernel_queue_cycles"}}
    assert Settings.from_config(trimmed).kernel_queue_cycles == 0


def test_published_protocol_plans_inside_for_baselines_only():
    log = Log()
    device = FakeDevice(l2_bytes=0)
    case = case_with(["flashinfer-tc", "pkv-workqueue"])
    settings_ = Settings(repeats=3, warmup=0, protocols=("published",))
    run_case(case, device, make_factory(log, {}), settings_, RunContext("r", log=lambda m: None))
    plans = [e for e in log.events if e[0] == "plan"]
    assert sum(1 for e in plans if e[1] == "flashinfer-tc" and e[2] == "published") == 1 + 3
    assert not any(e[1] == "pkv-workqueue" and e[2] == "published" for e in plans)
    assert sum(1 for e in plans if e[1] == "pkv-workqueue") == 1   # the case plan, made once


def test_step_protocol_plans_once_per_step_on_its_own_instance():
    log = Log()
    device = FakeDevice(l2_bytes=0)
    case = case_with(["vllm-fa3"])
    settings_ = Settings(layers=5, repeats=2, warmup=1, protocols=("step",))
    run_case(case, device, make_factory(log, {}), settings_, RunContext("r", log=lambda m: None))
    step_plans = [e for e in log.events if e[0] == "plan" and e[2] == "step"]
    step_runs = [e for e in log.events if e[0] == "run" and e[2] == "step"]
    assert len(step_plans) == 1 + 3 and len(step_runs) == 1 + 3 * 5
    assert sum(1 for e in log.events if e[0] == "plan" and e[2] == "main") == 1


def test_unavailable_failed_and_oom_rows_leave_others_measured():
    log = Log()
    device = FakeDevice(l2_bytes=0)
    behaviours = {"trtllm-native": {"reasons": ["tensorrt_llm cannot be imported"]},
                  "vllm-fa3": {"fail": "plan"},
                  "trtllm-xqa": {"fail": "oom"},
                  "flashinfer-cc": {"graph": "none"}}
    names = ["trtllm-native", "vllm-fa3", "trtllm-xqa", "flashinfer-cc", "flashinfer-tc"]
    settings_ = Settings(repeats=2, warmup=0)
    ctx = RunContext("r", log=lambda m: None)
    factory = make_factory(log, behaviours)
    rows = run_case(case_with(names), device, factory, settings_, ctx)
    rows += run_case(case_with(names, lengths=(5,)), device, factory, settings_, ctx, case_index=1)
    frame = raw_frame(rows)
    native = frame[frame["backend"] == "trtllm-native"]
    assert len(native) == 1 and native["status"].iloc[0] == "unavailable"   # once per experiment and spec
    vllm = frame[frame["backend"] == "vllm-fa3"]
    assert (vllm["status"] == "failed").all() and len(vllm) == 8
    assert vllm["reason"].str.contains("RuntimeError: planner exploded").all()
    assert not vllm["reason"].str.contains("second line").any()
    xqa = frame[frame["backend"] == "trtllm-xqa"]
    assert (xqa["status"] == "failed").all() and xqa["reason"].str.contains("OutOfMemoryError").all()
    assert device.emptied >= 1
    cc = frame[frame["backend"] == "flashinfer-cc"]
    kernel = cc[cc["protocol"] == "kernel"]
    assert len(kernel) == 2 and (kernel["status"] == "unavailable").all()
    assert kernel["reason"].str.contains("graph").all()
    assert (cc[cc["protocol"] != "kernel"]["status"] == "ok").all()
    tc = frame[frame["backend"] == "flashinfer-tc"]
    assert (tc["status"] == "ok").all() and len(tc) == 2 * 4 * 2


def test_a_failure_mid_run_keeps_earlier_repeats_and_says_which_repeat():
    log = Log()
    device = FakeDevice(l2_bytes=0)
    rows = run_case(case_with(["flashinfer-tc"]), device, make_factory(log, {"flashinfer-tc": {"fail": "second-eager"}}),
                    Settings(repeats=4, warmup=0, protocols=("eager",), eager_loop_calls=0),
                    RunContext("r", log=lambda m: None))
    frame = raw_frame(rows)
    ok, failed = frame[frame["status"] == "ok"], frame[frame["status"] == "failed"]
    assert len(ok) == 2 and len(failed) == 1 and "eager repeat 2" in failed["reason"].iloc[0]


def test_routes_and_counters_for_our_routes_and_adaptive():
    from types import SimpleNamespace

    log = Log()
    device = FakeDevice(l2_bytes=0)
    counters = {"launches": 2, "decode_ctas": 264, "merge_state_bytes": 1024}
    behaviours = {"pkv-buckets": {"counters": counters},
                  "adaptive": {"counters": counters, "decision": SimpleNamespace(backend="pkv-buckets")}}
    case = workload.synthetic_case("t", "c", [40], SPEC, (workload.Variant("pkv-buckets", (("num_splits", 8),)),
                                                          workload.Variant("adaptive"), workload.Variant("flashinfer-tc")))
    rows = run_case(case, device, make_factory(log, behaviours), Settings(repeats=2, warmup=0, protocols=("eager",)),
                    RunContext("r", log=lambda m: None))
    frame = raw_frame(rows).set_index("backend")
    assert frame.loc["pkv-buckets", "route"].tolist() == ["pkv-buckets"] * 2
    assert (frame.loc["pkv-buckets", "num_splits"] == 8).all() and (frame.loc["pkv-buckets", "launches"] == 2).all()
    assert (frame.loc["adaptive", "route"] == "pkv-buckets").all()
    assert (frame.loc["adaptive", "decode_ctas"] == 264).all()
    assert frame.loc["flashinfer-tc", "launches"].isna().all() and (frame.loc["flashinfer-tc", "num_splits"] == -1).all()


def test_harness_with_the_real_torch_sdpa_backend_on_cpu():
    case = workload.synthetic_case("t", "c", [33, 70], SPEC, (workload.Variant("torch-sdpa"), workload.Variant("numpy")))
    rows = run_case(case, TorchDevice("cpu", l2_bytes=0), BackendFactory(), Settings(layers=2, repeats=2, warmup=1),
                    RunContext("r", log=lambda m: None))
    frame = raw_frame(rows)
    sdpa = frame[frame["backend"] == "torch-sdpa"]
    assert (sdpa["status"] == "ok").all() and len(sdpa) == 8
    assert frame[frame["backend"] == "numpy"]["status"].tolist() == ["unavailable"]


# -- validation ----------------------------------------------------------------------------------
from persistentkv.measure import validation  # noqa: E402


def test_compare_counts_nan_and_unwritten():
    ref = np.ones((2, 4, 8))
    out = ref.copy()
    assert validation.compare(out, ref, 1e-3)["passed"]
    out[0, 0, :3] = validation.POISON
    got = validation.compare(out, ref, 1e-3)
    assert got["unwritten"] == 3 and not got["passed"]
    out[1, 1, 1] = np.nan
    got = validation.compare(out, ref, 1e-3)
    assert got["nan_count"] == 1 and got["rel_err"] == math.inf and got["max_abs_err"] == math.inf
    assert got["max_row_head_err"] == math.inf and (got["worst_row"], got["worst_head"]) == (1, 1)
    assert got["row_heads_failing"] == 2 and got["reason"] == (
        "row 1 head 1: rel err inf > 1e-03; 2 of 8 (row, head) over; 1 NaN; 3 elements never written")


def test_poison_is_exact_in_both_serving_dtypes():
    assert float(np.float16(validation.POISON)) == validation.POISON
    assert float(torch.tensor(validation.POISON, dtype=torch.bfloat16)) == validation.POISON


class SkipRowZero:
    """A broken backend: right everywhere except row 0, which it never writes."""

    name = "skipper"
    capabilities = Capabilities(dtypes=("float16", "bfloat16"), graph="device")

    def __init__(self, inner):
        self.inner = inner

    def unavailable(self, spec):
        return []

    def plan(self, batch):
        return self.inner.plan(batch)

    def run(self, q, cache, plan, out):
        keep = out[0].clone()
        self.inner.run(q, cache, plan, out)
        out[0] = keep


def test_validate_case_on_cpu_catches_unwritten_rows_and_reports_unavailable():
    from persistentkv.backends.torch_sdpa import TorchSdpaBackend

    spec = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="float16")
    case = workload.synthetic_case("v", "c", [1, 17, 300], spec,
                                   (workload.Variant("torch-sdpa"), workload.Variant("skipper"),
                                    workload.Variant("flashinfer-tc")), hole_fraction=0.5)

    def create(name, **options):
        if name == "skipper":
            return SkipRowZero(TorchSdpaBackend(device="cpu"))
        from persistentkv.backends import registry
        return registry.create(name, **options)

    rows = validation.validate_case(case, TorchDevice("cpu"), BackendFactory(create), dtypes=("float16", "bfloat16"),
                                    rtols={"float16": 2e-3, "bfloat16": 1e-2})
    by = {(r["backend"], r["dtype"]): r for r in rows}
    for dtype in ("float16", "bfloat16"):
        assert by[("torch-sdpa", dtype)]["passed"], by[("torch-sdpa", dtype)]
        bad = by[("skipper", dtype)]
        assert bad["status"] == "ok" and not bad["passed"] and bad["unwritten"] == 8 * 64
        assert "never written" in bad["reason"] and bad["reason"].startswith("row 0 head ")
        assert bad["worst_row"] == 0 and bad["row_heads_failing"] == 8
        if not torch.cuda.is_available():
            assert by[("flashinfer-tc", dtype)]["status"] == "unavailable"
    assert {r["backend"] for r in validation.failing(rows)} == {"skipper"}
    assert validation_frame(rows).shape[0] == 6


class E4m3Query:
    """torch-sdpa with its query rounded to e4m3 first, declaring it (Capabilities.fp8_query): an
    FP8-query baseline's error class, on the CPU."""

    name = "e4m3-query"

    def __init__(self):
        from dataclasses import replace

        from persistentkv.backends.torch_sdpa import TorchSdpaBackend

        self.inner = TorchSdpaBackend(device="cpu")
        self.capabilities = replace(self.inner.capabilities, fp8_query=True)

    def unavailable(self, spec):
        return self.inner.unavailable(spec)

    def plan(self, batch):
        return self.inner.plan(batch)

    def run(self, q, cache, plan, out):
        self.inner.run(q.to(torch.float8_e4m3fn).to(q.dtype), cache, plan, out)


def test_validate_case_over_an_fp8_cache_gates_every_backend_and_reports_an_fp8_query():
    spec = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="float16",
                         kv_dtype="float8_e4m3")
    case = workload.synthetic_case("v", "c", [1, 17, 300], spec,
                                   (workload.Variant("torch-sdpa"), workload.Variant("e4m3-query"),
                                    workload.Variant("skipper")), hole_fraction=0.5)

    def create(name, **options):
        from persistentkv.backends import registry

        if name == "e4m3-query":
            return E4m3Query()
        if name == "skipper":
            return SkipRowZero(registry.create("torch-sdpa", device="cpu"))
        return registry.create(name, device="cpu", **options)

    rows = validation.validate_case(case, TorchDevice("cpu"), BackendFactory(create), dtypes=("float16", "bfloat16"),
                                    rtols={"float16": 2e-3, "bfloat16": 1e-2})
    by = {(r["backend"], r["dtype"]): r for r in rows}
    assert {r["kv_dtype"] for r in rows} == {"float8_e4m3"}
    for dtype in ("float16", "bfloat16"):
        # the cache's own rounding is not an error: the reference reads the dequantised codes
        exact = by[("torch-sdpa", dtype)]
        assert exact["passed"] and not exact["fp8_query"], exact
        rounded = by[("e4m3-query", dtype)]
        assert rounded["fp8_query"] and rounded["status"] == "ok" and rounded["rtol"] == exact["rtol"]
        assert rounded["max_row_head_err"] > 1e-2  # e4m3 keeps 3 mantissa bits: the FP8-query class
        assert not rounded["passed"] and "reported, not gated" in rounded["reason"]
        assert not by[("skipper", dtype)]["passed"]
    assert {r["backend"] for r in validation.failing(rows)} == {"skipper"}
    frame = validation_frame(rows)
    assert frame["fp8_query"].dtype == bool and frame.shape[0] == 6


def test_fp8_inputs_are_codes_with_one_scale_per_tensor_and_their_exact_values():
    from persistentkv import fp8

    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((3, 16, 2, 8)).astype(np.float32) * s for s in (1.0, 100.0))
    (kc, vc, ks, vs), (k64, v64) = validation.fp8_inputs(k, v)
    assert kc.dtype == torch.float8_e4m3fn and ks.shape == (1,)
    for codes, scale, values, ref in ((kc, ks, k, k64), (vc, vs, v, v64)):
        assert float(scale[0]) == pytest.approx(np.abs(values).max() / 448.0)
        assert np.array_equal(ref, fp8.dequantize(codes.view(torch.uint8).numpy(), scale))
        assert np.abs(ref).max() <= 448.0 * float(scale[0]) and np.allclose(ref, values, rtol=0.07, atol=scale[0])


def test_host_inputs_are_seeded():
    batch = make_batch(SPEC, [20, 5])
    a, b = validation.host_inputs(batch, 3), validation.host_inputs(batch, 3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], validation.host_inputs(batch, 4)[0])


# -- provenance ----------------------------------------------------------------------------------
from persistentkv import provenance  # noqa: E402


def test_config_hash_is_canonical_and_sensitive(config):
    assert provenance.config_hash(config) == provenance.config_hash(json.loads(json.dumps(config)))
    changed = json.loads(json.dumps(config))
    changed["measure"]["repeats"] += 1
    assert provenance.config_hash(changed) != provenance.config_hash(config)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_state_in_and_out_of_a_repository(tmp_path):
    assert provenance.git_state(tmp_path) == (None, None)
    env = ["-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f").write_text("1")
    subprocess.run(["git", "-C", str(tmp_path), "add", "f"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), *env, "commit", "-qm", "x"], check=True)
    commit, dirty = provenance.git_state(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{40}", commit) and dirty is False
    (tmp_path / "f").write_text("2")
    assert provenance.git_state(tmp_path)[1] is True


def test_git_state_prefers_what_the_copier_says(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSISTENTKV_GIT_COMMIT", "a" * 40)
    monkeypatch.setenv("PERSISTENTKV_GIT_DIRTY", "0")
    assert provenance.git_state(tmp_path) == ("a" * 40, False)
    assert provenance.git_state(ROOT) == ("a" * 40, False)  # even inside a checkout (a stale .git)
    monkeypatch.delenv("PERSISTENTKV_GIT_DIRTY")
    assert provenance.git_state(tmp_path) == ("a" * 40, None)


def test_collect_and_sidecar(tmp_path, config):
    record = provenance.collect(config, [3, 1], "2026-11-29T00:00:00Z", TorchDevice("cpu"), argv=["pkv", "x y"])
    assert set(record) == set(provenance.FIELDS)
    assert record["seeds"] == [1, 3] and record["command"] == "pkv 'x y'" and record["torch"] == torch.__version__
    assert record["gpu"] is None  # never guessed
    out = tmp_path / "raw" / "published.parquet"
    path = provenance.write_sidecar(out, "rid", record)
    assert path == tmp_path / "raw" / "published.json"
    assert json.loads(path.read_text())["rid"]["config_hash"] == record["config_hash"]
    assert provenance.new_run_id("published", "2026-11-29T21:30:00Z").startswith("published-20261129T213000Z-")


# -- ceiling -------------------------------------------------------------------------------------
from persistentkv import ceiling  # noqa: E402


# -- the commands without a GPU ------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("argv", [
    ["measure", "--config", str(CONFIG), "--experiment", "published", "--out", "x.parquet"],
    ["bench-kernels", "--config", str(CONFIG), "--out", "x.parquet"],
    ["validate-gpu", "--config", str(CONFIG), "--out", "x.parquet"],
    ["validate-gpu", "--smoke"],
])
def test_gpu_commands_refuse_in_one_line_without_a_gpu(argv, tmp_path):
    done = subprocess.run([sys.executable, "-m", "persistentkv", *argv], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("error: no CUDA device") and done.stderr.count("\n") == 1
    assert not (tmp_path / "x.parquet").exists()


def test_parse_backends_rejects_unknown_names():
    from persistentkv.commands.measure import parse_backends

    assert parse_backends("flashinfer-tc, vllm-fa3") == ["flashinfer-tc", "vllm-fa3"]
    assert parse_backends(None) is None
    with pytest.raises(PKVError, match="unknown backend"):
        parse_backends("flashinfer-tc,warp-drive")


# -- the command body end to end, with fake backends on the CPU -----------------------------------
def test_run_experiment_writes_raw_rows_and_a_matching_sidecar(tmp_path, monkeypatch, traces_dir, capsys):
    import pandas as pd

    from persistentkv.measure import runner

    log = Log()
    monkeypatch.setattr(runner, "_device", lambda: FakeDevice(l2_bytes=0))

    def fake_ceilings(device, quick):
        return [ceiling.CeilingSample("read-ceiling", 0, 4 * 10**9, 1000.0)], {}

    monkeypatch.setattr(runner, "_ceilings", fake_ceilings)
    monkeypatch.setattr(runner, "BackendFactory", lambda: make_factory(log, {"vllm-fa3": {"fail": "plan"}}))
    out = tmp_path / "raw" / "long_context.parquet"
    rc = runner.run_experiment(str(CONFIG), "long_context", str(traces_dir), str(out), None,
                               ["flashinfer-tc", "pkv-buckets", "vllm-fa3"], quick=True)
    assert rc == 0
    frame = pd.read_parquet(out)
    assert list(frame.columns) == list(RAW_COLUMNS)
    run_ids = set(frame["run_id"])
    assert len(run_ids) == 1
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert list(sidecar) == list(run_ids)
    assert set(sidecar[next(iter(run_ids))]) == set(provenance.FIELDS)
    ok = frame[(frame["status"] == "ok") & (frame["protocol"] != "ceiling")]
    assert set(ok["backend"]) == {"flashinfer-tc", "pkv-buckets"}
    assert set(ok["protocol"]) == {"kernel", "eager", "step", "published"}
    assert (ok["read_ceiling_gbps"] == 4000.0).all()
    assert sorted(set(ok["max_len"])) == sorted(configuration.load_config(CONFIG)["measure"]["long_context"]["lengths"][:2])
    assert (frame[frame["backend"] == "vllm-fa3"]["status"] == "failed").all()
    assert "vllm-fa3" in capsys.readouterr().err   # the summary names what failed


def test_a_run_stopped_part_way_keeps_its_finished_cases_rows_beside_its_output(tmp_path, monkeypatch, traces_dir,
                                                                                  capsys):
    """A fault that escapes a case (a device fault, an interrupt) stops the run: the output is not
    written, the finished cases' rows (with the ceiling rows measured before them) stay in
    partial/ with a sidecar saying how far it got and why, and the results loader never reads
    them. A run that completes leaves no partial/ behind."""
    import pandas as pd

    from persistentkv.measure import harness, runner
    from persistentkv.results import load_results

    log = Log()
    monkeypatch.setattr(runner, "_device", lambda: FakeDevice(l2_bytes=0))
    monkeypatch.setattr(runner, "_ceilings",
                        lambda device, quick: ([ceiling.CeilingSample("read-ceiling", 0, 4 * 10**9, 1000.0)], {}))
    monkeypatch.setattr(runner, "BackendFactory", lambda: make_factory(log, {}))
    monkeypatch.setattr(runner, "PARTIAL_EVERY_S", 0.0)
    out = tmp_path / "raw" / "long_context.parquet"
    args = (str(CONFIG), "long_context", str(traces_dir), str(out), None, ["flashinfer-tc", "pkv-buckets"])
    real, calls = harness.run_case, []

    def faulting(case, *a, **k):
        calls.append(case)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
        return real(case, *a, **k)

    monkeypatch.setattr(harness, "run_case", faulting)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        runner.run_experiment(*args, quick=True)
    assert not out.exists() and not out.with_suffix(".json").exists()
    kept = tmp_path / "raw" / "partial" / "long_context.parquet"
    frame = pd.read_parquet(kept)
    assert list(frame.columns) == list(RAW_COLUMNS)
    assert set(frame["trace"]) - {"read-ceiling"} == {calls[0].trace}          # the first case only
    assert (frame[frame["backend"] == "read-ceiling"]["status"] == "ok").all()
    (record,) = json.loads(kept.with_suffix(".json").read_text()).values()
    assert record["complete"] is False and record["cases"]["done"] == 1 and record["cases"]["total"] >= 2
    assert record["stopped_by"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert "stopped after 1 of" in capsys.readouterr().err
    assert load_results(tmp_path).raw.empty                                   # never read as a result

    monkeypatch.setattr(harness, "run_case", real)
    assert runner.run_experiment(*args, quick=True) == 0
    assert out.exists() and not (tmp_path / "raw" / "partial").exists()


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3"])
def test_validate_gpu_runs_every_trace_step_and_the_long_row_on_the_cache_asked_for(tmp_path, monkeypatch,
                                                                                       traces_dir, kv_dtype):
    from persistentkv.measure import runner

    monkeypatch.setattr(runner, "_device", lambda: FakeDevice(l2_bytes=0))
    seen = []

    def validate_case(case, device, factory, rtols, log):
        seen.append(case)
        return [{"backend": "pkv-workqueue", "trace": case.trace, "seed": 0, "step": int(case.step),
                 "dtype": "float16", "kv_dtype": case.spec.cache_dtype, "fp8_query": False, "rel_err": 1e-4,
                 "max_row_head_err": 3e-4, "worst_row": 0, "worst_head": 0, "row_heads_failing": 0,
                 "max_abs_err": 1e-4, "rtol": 1e-2, "passed": True, "nan_count": 0, "unwritten": 0, "status": "ok",
                 "reason": ""}]

    monkeypatch.setattr(runner, "validate_case", validate_case)
    out = tmp_path / "validation_gpu.parquet"
    assert runner.run_validation(str(CONFIG), str(traces_dir), str(out), None, ["pkv-workqueue"], kv_dtype) == 0
    config = configuration.load_config(CONFIG)
    gpu = config["validation"]["gpu"]
    assert len(seen) == len(config["traces"]) * gpu["steps_per_trace"] + 1
    assert {c.spec.cache_dtype for c in seen} == {kv_dtype or config["spec"]["dtype"]}
    long = seen[-1]
    assert long.trace == f"B1xN{gpu['long_row']}" and long.batch.seq_lens.tolist() == [gpu["long_row"]]
    pages = long.batch.kv_indices
    assert pages.size == -(-gpu["long_row"] // long.spec.page_size) and (np.diff(pages) != 1).any()  # scattered


def test_validate_gpu_stopped_part_way_keeps_the_finished_steps(tmp_path, monkeypatch, traces_dir):
    import pandas as pd

    from persistentkv.measure import runner

    monkeypatch.setattr(runner, "_device", lambda: FakeDevice(l2_bytes=0))
    monkeypatch.setattr(runner, "PARTIAL_EVERY_S", 0.0)
    seen = []

    def validate_case(case, device, factory, rtols, log):
        seen.append(case)
        if len(seen) == 3:
            raise KeyboardInterrupt
        return [{"backend": "pkv-workqueue", "trace": case.trace, "seed": 0, "step": int(case.step),
                 "dtype": "float16", "kv_dtype": "float16", "fp8_query": False, "rel_err": 1e-4,
                 "max_row_head_err": 3e-4, "worst_row": 0, "worst_head": 0,
                 "row_heads_failing": 0, "max_abs_err": 1e-4, "rtol": 1e-2, "passed": True,
                 "nan_count": 0, "unwritten": 0, "status": "ok", "reason": ""}]

    monkeypatch.setattr(runner, "validate_case", validate_case)
    out = tmp_path / "validation_gpu.parquet"
    with pytest.raises(KeyboardInterrupt):
        runner.run_validation(str(CONFIG), str(traces_dir), str(out), None, ["pkv-workqueue"])
    assert not out.exists()
    kept = pd.read_parquet(tmp_path / "partial" / "validation_gpu.parquet")
    assert len(kept) == 2 and set(kept["status"]) == {"ok"}
    (record,) = json.loads((tmp_path / "partial" / "validation_gpu.json").read_text()).values()
    assert record["cases"]["done"] == 2 and record["stopped_by"] == "KeyboardInterrupt"


def test_partial_rows_write_at_most_every_interval_and_always_at_a_stop(tmp_path):
    from persistentkv.measure import runner

    frames = []
    partial = runner.PartialRows(str(tmp_path / "x.parquet"), "r", lambda: {"gpu": "g"}, 3,
                                 lambda rows: frames.append(list(rows)) or pd_frame(rows), every_s=60.0)
    now = [0.0]
    partial.clock, partial.written_at = (lambda: now[0]), 0.0
    rows = [{"a": 1}]
    partial.save(rows, 1)
    assert frames == [] and not partial.path.exists()      # within the interval: kept, not written
    now[0] = 61.0
    rows.append({"a": 2})
    partial.save(rows, 2)
    assert frames == [[{"a": 1}, {"a": 2}]] and partial.path.exists()
    rows.append({"a": 3})
    partial.save(rows, 3)                                    # 0 s later: not written
    partial.stopped(KeyboardInterrupt())
    assert frames[-1] == [{"a": 1}, {"a": 2}, {"a": 3}]
    (record,) = json.loads(partial.path.with_suffix(".json").read_text()).values()
    assert record["stopped_by"] == "KeyboardInterrupt" and record["cases"] == {"done": 3, "total": 3}
    assert record["gpu"] == "g"                              # the provenance, collected at the first write
    partial.finish()
    assert not partial.path.exists() and not partial.path.parent.exists()


def test_partial_rows_that_cannot_be_written_never_stop_the_run(tmp_path, capsys):
    from persistentkv.measure import runner

    blocked = tmp_path / "blocked"
    blocked.write_text("a file where partial/'s parent folder would be")
    partial = runner.PartialRows(str(blocked / "x.parquet"), "r", dict, 2, pd_frame, every_s=0.0)
    partial.save([{"a": 1}], 1)                              # cannot write: said, not raised
    partial.save([{"a": 1}, {"a": 2}], 2)                    # and not tried again
    assert capsys.readouterr().err.count("the run goes on") == 1
    partial.stopped(RuntimeError("fault"))                   # nor at the stop
    assert "could not keep the finished rows" in capsys.readouterr().err


def pd_frame(rows):
    import pandas as pd

    return pd.DataFrame(rows)


def test_experiment_protocols_come_from_config_in_canonical_order():
    from persistentkv.measure.harness import experiment_protocols
    from persistentkv.names import PROTOCOLS

    config = {"measure": {"protocols": {"split_sensitivity": ["step", "kernel"]}}}
    assert experiment_protocols(config, "split_sensitivity") == ("kernel", "step")
    assert experiment_protocols(config, "published") == PROTOCOLS
    assert experiment_protocols({"measure": {}}, "published") == PROTOCOLS


def test_experiment_protocols_refuse_unknown_names():
    from persistentkv.errors import PKVError
    from persistentkv.measure.harness import experiment_protocols

    with pytest.raises(PKVError, match="measure.protocols.batch_sweep: unknown protocol"):
        experiment_protocols({"measure": {"protocols": {"batch_sweep": ["kernel", "graph"]}}}, "batch_sweep")


# -- the kernel protocol's separator -------------------------------------------------------------
class SeparatedDevice(FakeDevice):
    """FakeDevice whose separator logs ("sep", nbytes) into the shared log on every launch."""

    def separator(self, nbytes):
        launch = super().separator(nbytes)

        def logged():
            self.log.events.append(("sep", nbytes))
            launch()
        return logged


def test_separator_bytes_are_the_steps_appended_kv():
    case = case_with(["pkv-workqueue"], lengths=(40, 17, 3))
    # 3 rows x (K and V) x 2 kv heads x 64 x 4 bytes (float32)
    assert harness.separator_bytes(case.batch) == 3 * 2 * 2 * 64 * 4


def test_kernel_rows_with_a_separator_follow_one_each_and_subtract_it():
    log = Log()
    device = SeparatedDevice(l2_bytes=0, log=log)
    log.events.clear()
    case = case_with(["flashinfer-tc", "pkv-workqueue"])
    settings_ = Settings(layers=1, repeats=2, warmup=0, calls_per_graph=3, protocols=("kernel", "eager"),
                         kernel_separator=True)
    rows = run_case(case, device, make_factory(log, {}), settings_, RunContext("r", 1000.0, log=lambda m: None))
    frame = raw_frame(rows)
    assert (frame["status"] == "ok").all()
    kernel, eager = frame[frame["protocol"] == "kernel"], frame[frame["protocol"] == "eager"]
    assert len(kernel) == 4 and (kernel["separator_us"] >= 0).all() and eager["separator_us"].isna().all()
    nbytes = harness.separator_bytes(case.batch)
    seps = [e for e in log.events if e[0] == "sep"]
    assert seps and all(e == ("sep", nbytes) for e in seps)
    # on the CPU a "graph" re-runs its function: every main-role run of the kernel graphs follows a
    # separator, and the eager protocol's runs do not
    runs = [i for i, e in enumerate(log.events) if e[0] == "run" and e[2] == "main"]
    after_sep = [i for i in runs if log.events[i - 1][0] == "sep"]
    assert len(after_sep) >= 3 * 2 * 2 and len(after_sep) < len(runs)


def test_kernel_separator_comes_from_the_config_and_must_be_a_boolean():
    config = configuration.load_config(str(ROOT / "config" / "config.yaml"))
    assert config["measure"]["kernel_separator"] is True
    assert Settings.from_config(config).kernel_separator is True
    bad = {**config, "measure": {**config["measure"], "kernel_separator": "yes"}}
    with pytest.raises(PKVError, match="kernel_separator must be true or false"):
        Settings.from_config(bad)


@pytest.mark.parametrize("argv, expected", [
    (["validate-gpu", "--config", "c.yaml", "--out", "v.parquet", "--kv-dtype", "float8_e5m2"],
     "--kv-dtype 'float8_e5m2' is not one of auto, float8_e4m3"),
    (["validate-gpu", "--smoke", "--kv-dtype", "float8_e4m3"], "validate-gpu --smoke runs the query's dtype only"),
])
def test_validate_gpu_refuses_a_bad_kv_dtype_before_looking_for_a_gpu(argv, expected, capsys):
    from persistentkv import cli

    code = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0], err


def test_graph_capture_runs_with_the_cycle_collector_off(monkeypatch):
    """A cycle collection inside a capture can destroy another garbage CUDA graph, which invalidates
    the capture: capture_graph holds the collector off around both capture paths, and restores it."""
    import gc
    from contextlib import nullcontext

    torch = pytest.importorskip("torch")
    from persistentkv.measure import device

    seen = []

    class FakeGraph:
        def capture_begin(self):
            seen.append(("begin", gc.isenabled()))

        def capture_end(self):
            seen.append(("end", gc.isenabled()))

        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, stream=None: nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert gc.isenabled()
    for free_cached in (True, False):
        seen.clear()
        replay = device.capture_graph(lambda: seen.append(("fn", gc.isenabled())), "cpu", free_cached=free_cached)
        assert callable(replay) and gc.isenabled()
        assert seen and all(on is False for _, on in seen), seen
    with pytest.raises(RuntimeError, match="boom"):
        device.capture_graph(lambda: (_ for _ in ()).throw(RuntimeError("boom")), "cpu", free_cached=False)
    assert gc.isenabled()
    gc.disable()
    try:
        with device.cycle_collector_off():
            assert not gc.isenabled()
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()
