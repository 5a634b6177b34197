"""The one-kernel floor on the CPU: its grids, vectors, cold-L2 copies and graphs, the best-of-grids
choice against a fake timer, its raw rows, and its place in the harness's rounds (bench-kernels,
bench-shapes); the shapes experiment's grid from the real config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from persistentkv import ceiling, configuration
from persistentkv.errors import PKVError
from persistentkv.measure import statistics, workload
from persistentkv.measure.harness import RunContext, Settings, one_kernel_floor, run_case
from persistentkv.measure.rows import floor_rows, raw_frame
from persistentkv.names import BASELINES, CEILING_BACKENDS, FLOOR_BACKEND, PKV_BACKENDS, SHAPES_EXPERIMENT
from persistentkv.spec import AttentionSpec, shapes_tokens

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
L2 = 60 * MiB


# -- the pure parts ------------------------------------------------------------------------------
def test_floor_vectors_round_up_to_whole_16_byte_loads():
    assert ceiling.floor_vectors(16) == 1
    assert ceiling.floor_vectors(17) == 2
    assert ceiling.floor_vectors(4 * MiB) == 4 * MiB // 16
    spec = AttentionSpec(32, 8, 128, 16, "float16")   # a step's bytes are whole vectors: read exactly
    assert ceiling.floor_vectors(1000 * spec.kv_bytes_per_token) * 16 == 1000 * spec.kv_bytes_per_token
    with pytest.raises(PKVError, match="positive byte count"):
        ceiling.floor_vectors(0)


def test_floor_grids_worked_number_and_cap():
    # 4 MiB = 262144 vectors = 1024 blocks of 256 threads: 8 x 132 = 1056 is capped to 1024
    assert ceiling.floor_grids(132, 4 * MiB // 16) == [132, 264, 528, 1024]
    assert ceiling.floor_grids(132, 256 * MiB // 16) == [132, 264, 528, 1056]
    assert ceiling.floor_grids(132, 300) == [2]            # every grid capped to the blocks with work
    assert ceiling.floor_grids(4, 10**6, blocks_per_sm=(2, 1, 2)) == [4, 8]
    with pytest.raises(PKVError, match="SM count"):
        ceiling.floor_grids(0, 100)


def test_floor_launches_walk_the_copies_whole():
    assert ceiling.floor_launches(3, 10) == 12
    assert ceiling.floor_launches(45, 10) == 45
    assert ceiling.floor_launches(1, 10) == 10
    assert ceiling.floor_launches(5, 10) == 10
    for copies in range(1, 30):
        n = ceiling.floor_launches(copies, 10)
        assert n >= 10 and n % copies == 0 and n - copies < max(10, copies)


def test_floor_copies_keep_l2_cold_and_refuse_what_memory_cannot_hold():
    assert ceiling.floor_copies(4 * MiB, L2, 3.0, 10**12, 64) == 45      # ceil(180 / 4)
    assert ceiling.floor_copies(256 * MiB, L2, 3.0, 10**12, 64) == 1
    assert ceiling.floor_copies(4 * MiB, L2, 3.0, 10**12, 8) == 8        # the harness's cap
    assert ceiling.cold_copies(4096 * 4096, 60 * 10**6, 3) == 11         # the rotation's worked number
    with pytest.raises(PKVError, match="memory holds 2"):
        ceiling.floor_copies(4 * MiB, L2, 3.0, 15 * MiB, 64)
    with pytest.raises(PKVError, match="needs 1.00 GiB"):
        ceiling.floor_copies(2**30, L2, 3.0, 2**30, 64)


def test_best_grid_is_the_lowest_median_and_the_smaller_grid_on_a_tie():
    assert ceiling.best_grid({132: [5.0, 9.0, 5.1], 264: [4.0, 6.0, 6.0], 528: [4.5, 4.5, 99.0]}) == 528
    assert ceiling.best_grid({528: [3.0], 264: [3.0]}) == 264
    assert ceiling.best_grid({132: [], 264: [7.0]}) == 264
    with pytest.raises(PKVError, match="no timed grid"):
        ceiling.best_grid({132: []})


# -- the floor against a fake device and timer -------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.t = 0.0


class FakeEvent:
    def __init__(self, clock):
        self.clock, self.t = clock, None

    def record(self):
        self.t = self.clock.t

    def elapsed_ms(self, end):
        return (end.t - self.t) * 1e3


class FakeFloorDevice:
    """A GPU stand-in: 132 SMs, 60 MiB of L2; a captured graph replays its launches, each advancing the
    clock by ``cost(grid)`` seconds; eager launches cost nothing (they are not timed)."""

    def __init__(self, cost, free=10**12, sm_count=132, l2=L2):
        self.clock, self.cost = FakeClock(), cost
        self.sm_count, self.l2_bytes, self.free = sm_count, l2, free
        self.capturing, self.graphs, self.eager, self.spins = None, [], [], []

    def free_bytes(self):
        return self.free

    def event(self):
        return FakeEvent(self.clock)

    def synchronize(self):
        pass

    def queue_ahead(self, cycles):
        self.spins.append(cycles)

    def is_oom(self, exc):
        return False

    def empty_cache(self):
        pass

    def capture(self, fn):
        self.capturing = []
        fn()
        launches, self.capturing = self.capturing, None
        self.graphs.append(launches)

        def replay():
            for grid, _ in launches:
                self.clock.t += self.cost(grid)
        return replay


class FakeReader:
    def __init__(self, device, copies, n_vec):
        self.device, self.copies, self.n_vec = device, copies, n_vec

    def launch(self, grid, slot):
        assert 0 <= slot < self.copies
        (self.device.capturing if self.device.capturing is not None else self.device.eager).append((grid, slot))


def cost_by_grid(grid):   # us -> s: the 528-block grid is the fastest
    return {132: 9e-6, 264: 6e-6, 528: 5e-6, 1024: 5.5e-6, 1056: 5.5e-6}[grid]


def test_one_kernel_floor_graphs_walk_every_copy_and_time_per_launch():
    device = FakeFloorDevice(cost_by_grid)
    floor = ceiling.OneKernelFloor(device, 4 * MiB, cold_l2_factor=3.0, calls_per_graph=10, queue_cycles=77,
                                   reader=FakeReader)
    assert (floor.copies, floor.launches, floor.grids) == (45, 45, [132, 264, 528, 1024])
    # one eager launch per grid before its capture, then one graph per grid walking copies 0..44
    assert device.eager == [(g, 0) for g in floor.grids]
    assert [[s for _, s in g] for g in device.graphs] == [list(range(45))] * 4
    assert [{gr for gr, _ in g} for g in device.graphs] == [{g} for g in floor.grids]
    floor.round(record=False)
    for _ in range(3):
        floor.round()
    result = floor.result()
    assert all(len(v) == 3 for v in result.samples.values())
    assert result.samples[528] == pytest.approx([5.0] * 3) and result.samples[132] == pytest.approx([9.0] * 3)
    assert result.grid == 528 and result.median_us == pytest.approx(5.0)
    assert device.spins == [77] * 16                      # every replay queued behind the spin
    assert "528: 5.00" in result.summary() and "45 cold-L2 copies" in result.summary()


def test_one_kernel_floor_rotates_the_grid_order_each_round():
    order = []
    device = FakeFloorDevice(lambda g: order.append(g) or 1e-6)
    floor = ceiling.OneKernelFloor(device, 256 * MiB, cold_l2_factor=3.0, calls_per_graph=2, reader=FakeReader)
    assert floor.launches == 2
    for _ in range(4):
        floor.round()
    firsts = order[::2 * len(floor.grids)]   # two launches per replay
    assert firsts == floor.grids             # each grid goes first once in four rounds


def test_measure_floor_discards_the_warmup_rounds():
    device = FakeFloorDevice(cost_by_grid)
    result = ceiling.measure_floor(device, 16 * MiB, repeats=4, warmup=2, reader=FakeReader)
    assert result.copies == 12 and result.launches == 12 and all(len(v) == 4 for v in result.samples.values())


# -- in the harness --------------------------------------------------------------------------------
SPEC = AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")


def _harness(protocols=("kernel", "eager"), fail_round=None, l2=2_000_000):
    from test_measure import FakeDevice, Log, case_with, make_factory  # the harness's CPU fakes

    log = Log()
    device = FakeDevice(l2_bytes=l2)
    device.sm_count = 4
    case = case_with(["flashinfer-tc", "pkv-workqueue"])
    settings = Settings(layers=1, repeats=3, warmup=1, calls_per_graph=4, protocols=protocols)
    visits = []

    class Reader(FakeReader):
        def __init__(self, dev, copies, n_vec):
            self.copies, self.n_vec, self.device = copies, n_vec, dev

        def launch(self, grid, slot):
            visits.append((grid, slot))
            if fail_round is not None and len(visits) > fail_round:
                raise RuntimeError("the read kernel failed")

    def floor(case_, device_, settings_):
        return one_kernel_floor(case_, device_, settings_, reader=Reader)

    rows = run_case(case, device, make_factory(log, {}), settings, RunContext("r", 1000.0, log=lambda m: None,
                                                                              floor=floor))
    return raw_frame(rows), case, log, visits


def test_harness_times_the_floor_in_every_round_beside_the_backends():
    frame, case, log, visits = _harness()
    fl = frame[frame["backend"] == FLOOR_BACKEND]
    assert len(fl) == 3 and (fl["status"] == "ok").all() and sorted(fl["repeat"]) == [0, 1, 2]
    assert (fl["protocol"] == "kernel").all() and (fl["kv_bytes"] == case.batch.kv_bytes).all()
    assert (fl["time_us"] > 0).all() and fl["frac_of_ceiling"].notna().all()
    assert fl["route"].str.fullmatch(r"read-\d+x256").all() and fl["reason"].str.contains("best of grids").all()
    assert (fl["num_qo_heads"] == SPEC.num_qo_heads).all() and (fl["trace"] == case.trace).all()
    # the attention rows are as without the floor
    assert len(frame[(frame["backend"] != FLOOR_BACKEND)]) == 2 * 2 * 3
    n_vec = ceiling.floor_vectors(case.batch.kv_bytes)
    assert {g for g, _ in visits} == set(ceiling.floor_grids(4, n_vec))
    # interleaved: the floor's graphs are replayed between the backends' rounds (CPU replay re-runs fn)
    assert len(visits) > len(ceiling.floor_grids(4, n_vec)) * 4 * 3


def test_harness_without_kernel_rows_or_floor_times_no_floor():
    frame, *_ = _harness(protocols=("eager",))
    assert FLOOR_BACKEND not in set(frame["backend"])


def test_a_floor_that_fails_gives_one_failed_row_and_leaves_the_backends_alone():
    frame, *_ = _harness(fail_round=30)
    fl = frame[frame["backend"] == FLOOR_BACKEND]
    assert len(fl) == 1 and fl["status"].iloc[0] == "failed" and "read kernel failed" in fl["reason"].iloc[0]
    assert (frame[frame["backend"] != FLOOR_BACKEND]["status"] == "ok").all()


def test_floor_rows_stay_out_of_the_attention_cells_and_the_baselines():
    assert FLOOR_BACKEND in CEILING_BACKENDS and FLOOR_BACKEND not in BASELINES
    frame, *_ = _harness()
    table = statistics.kernel_table(frame)
    assert table["frac_of_floor"].iloc[0] == pytest.approx(table[FLOOR_BACKEND].iloc[0] / table["best_pkv"].iloc[0])
    assert table["best_baseline"].iloc[0] == table["flashinfer-tc"].iloc[0]


# -- the shapes grid ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def config():
    return configuration.load_config(ROOT / "config" / "config.yaml")


def test_shapes_tokens_hit_the_bytes_in_whole_pages():
    spec = AttentionSpec(8, 2, 128, 16, "float16")            # 1 KiB per token
    assert shapes_tokens(16 * MiB, 4, spec, 2**20) == 4096
    assert shapes_tokens(16 * MiB + 7000, 4, spec, 2**20) == 4096  # nearest page
    assert shapes_tokens(4 * MiB, 1, AttentionSpec(4, 1, 128, 16, "float16"), 2**20) == 8192
    assert shapes_tokens(256 * MiB, 1, AttentionSpec(4, 1, 128, 16, "float16"), 2**18) is None
    assert shapes_tokens(4096, 16, spec, 2**20) is None   # under one page


def test_shapes_grid_from_the_config(config):
    cases, skipped = workload.shapes_cases(config)
    # Hkv=1 at B=1 x 1 GiB would need 2M-token rows: over max_tokens_per_row, skipped at both G
    assert len(cases) == 3 * 2 * 6 * 5 - 2
    assert len(skipped) == 2 and all("Hkv=1" in s and "B=1 " in s and "1024 MiB" in s for s in skipped)
    assert {c.experiment for c in cases} == {SHAPES_EXPERIMENT}
    assert {(c.spec.num_kv_heads, c.spec.num_qo_heads // c.spec.num_kv_heads) for c in cases} == \
        {(h, g) for h in (1, 2, 8) for g in (4, 8)}
    assert {c.batch.kv_bytes for c in cases} == {m * MiB for m in (4, 16, 64, 256, 1024)}
    lengths = [int(n) for c in cases for n in c.batch.seq_lens]
    assert min(lengths) == 16 and max(lengths) == 2**20       # Hkv=8 B=64 at 4 MiB; Hkv=2 B=1 at 1 GiB
    assert all(c.spec.head_dim == 128 and c.spec.page_size == 16 and c.spec.dtype == "float16" for c in cases)
    assert all(int(max(c.batch.seq_lens)) <= config["measure"]["bench_shapes"]["max_tokens_per_row"] for c in cases)
    names = {v.name for v in cases[0].variants}
    assert names == {n for n in config["measure"]["backends"] if n in PKV_BACKENDS or n in BASELINES}
    quick, _ = workload.shapes_cases(config, quick=True)
    assert len(quick) == 2 * 2 * 2 - 1        # the ends of Hkv, B and bytes, the first G; Hkv=1 B=1 x 1 GiB skipped
    only, _ = workload.shapes_cases(config, ["pkv-workqueue"])
    assert {v.name for v in only[0].variants} == {"pkv-workqueue"}


def test_shapes_grid_skips_what_does_not_fit(config):
    m = config["measure"]
    small = {**config, "measure": {**m, "bench_shapes": {**m["bench_shapes"], "max_tokens_per_row": 65536}}}
    cases, skipped = workload.shapes_grid(small)
    assert skipped and all("over 65536" in s for s in skipped)
    assert all(max(lengths) <= 65536 for _, _, lengths in cases)
    assert len(cases) + len(skipped) == 180
    with pytest.raises(PKVError, match="bench_shapes is missing"):
        workload.shapes_grid({**config, "measure": {k: v for k, v in m.items() if k != "bench_shapes"}})


def test_shapes_config_is_checked_by_the_schema(config):
    import copy

    bad = copy.deepcopy(config)
    bad["measure"]["bench_shapes"]["kv_heads"] = [0]
    with pytest.raises(PKVError, match="bench_shapes"):
        configuration.validate_config(bad, ROOT)


@pytest.mark.parametrize("change, cells", [
    ({"kv_mib": [0.001]}, 3 * 2 * 6),                                 # 1 KiB: under one 16-token page at every B
    ({"kv_mib": [4096], "max_tokens_per_row": 1024, "batch_sizes": [1]}, 3 * 2),  # rows of 0.5M-4M tokens
])
def test_a_shapes_grid_where_no_cell_fits_is_refused_when_the_config_loads(config, change, cells):
    """Not a run that measures nothing: the config check names the key, the count and the first cell."""
    import copy

    bad = copy.deepcopy(config)
    bad["measure"]["bench_shapes"].update(change)
    refused = r"^config: measure\.bench_shapes: no cell of the grid fits: each of its \d+ would"
    with pytest.raises(PKVError, match=refused) as info:
        configuration.validate_config(bad, ROOT)
    assert f"each of its {cells} would" in str(info.value) and "(the first: Hkv=1 G=4 B=1 at" in str(info.value)
    assert f"max_tokens_per_row={bad['measure']['bench_shapes']['max_tokens_per_row']}" in str(info.value)
    one = copy.deepcopy(bad)
    one["measure"]["bench_shapes"]["kv_mib"].append(16)          # one size that fits: accepted
    one["measure"]["bench_shapes"]["max_tokens_per_row"] = 2**20
    configuration.validate_config(one, ROOT)


# -- the separator: each timed call after one small kernel, its own time subtracted -----------------
class FakeSeparator:
    """A separator stand-in: a launch is ("sep", -1) in the capture (cost: the device's cost(-1))."""

    def __init__(self, device):
        self.device, self.calls = device, 0

    def __call__(self):
        self.calls += 1
        (self.device.capturing if self.device.capturing is not None else self.device.eager).append((-1, -1))


def cost_with_separator(grid):   # the separator costs 2 us, the reads as cost_by_grid
    return 2e-6 if grid == -1 else cost_by_grid(grid)


def test_floor_with_a_separator_reads_after_each_one_and_subtracts_their_own_time():
    device = FakeFloorDevice(cost_with_separator)
    separator = FakeSeparator(device)
    floor = ceiling.OneKernelFloor(device, 4 * MiB, cold_l2_factor=3.0, calls_per_graph=10, reader=FakeReader,
                                   separator=separator)
    alone, *graphs = device.graphs
    assert alone == [(-1, -1)] * floor.launches                       # the separators' graph, alone
    for graph in graphs:                                              # every read right after one
        assert [g for g, _ in graph[0::2]] == [-1] * floor.launches
        assert [s for _, s in graph[1::2]] == list(range(floor.launches))
    floor.round(record=False)
    floor.round()
    floor.round()
    result = floor.result()
    assert result.samples[528] == pytest.approx([5.0, 5.0]) and result.samples[132] == pytest.approx([9.0, 9.0])
    assert result.separator_samples[528] == pytest.approx([2.0, 2.0])
    assert "each after a separator kernel" in result.summary()
    rows = floor_rows(result, {"kv_bytes": 4 * MiB, "run_id": "r"}, 4000.0)
    assert [r["separator_us"] for r in rows] == pytest.approx([2.0, 2.0])
    assert [r["time_us"] for r in rows] == pytest.approx([5.0, 5.0])


def test_floor_without_a_separator_has_no_separator_samples():
    device = FakeFloorDevice(cost_by_grid)
    result = ceiling.measure_floor(device, 16 * MiB, repeats=2, warmup=0, reader=FakeReader)
    assert result.separator_samples == {} and "separator" not in result.summary()
    rows = floor_rows(result, {"kv_bytes": 16 * MiB, "run_id": "r"}, 4000.0)
    assert all(np.isnan(r["separator_us"]) for r in rows)


def test_kernel_once_subtracts_the_separators_replayed_right_before():
    from persistentkv.measure.protocols import kernel_once
    from persistentkv.measure.rotation import CopyCursor

    device = FakeFloorDevice(cost_by_grid)
    order = []

    def replay(us):
        def run():
            order.append(us)
            device.clock.t += us * 1e-6
        return run

    fields = kernel_once(device, [replay(70.0)], CopyCursor(1, 10), 10, queue_cycles=5, separators=replay(20.0))
    assert order == [20.0, 70.0]                       # the separators first, then the graph
    assert fields["time_us"] == pytest.approx(5.0) and fields["separator_us"] == pytest.approx(2.0)
    assert device.spins == [5, 5]                      # both windows behind the spin
    plain = kernel_once(device, [replay(70.0)], CopyCursor(1, 10), 10)
    assert plain == {"time_us": pytest.approx(7.0), "layers": 1}
