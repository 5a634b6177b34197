"""measure-e2e keeps what it measured: after every configuration its rows are on disk, marked
partial, and the last write replaces them with the whole run (CPU: the GPU parts are replaced at
their boundary, the device, the ceilings, the weights and the timing of one configuration)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from persistentkv import configuration
from persistentkv.ceiling import CeilingSample

pytest.importorskip("torch", reason="measure-e2e runs its configurations under torch.no_grad()")

from persistentkv.commands import measure_e2e as e2e  # noqa: E402
from persistentkv.measure.schedule import round_order  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config" / "config.yaml"
CELLS = [(1, 4096), (4, 4096), (16, 4096)]
#: The read kernel's rate before the cases and after them (GB/s): the run's ceiling is the higher.
BEFORE_GBPS, AFTER_GBPS = 4000.0, 4400.0


class FakeDevice:
    name = "fake (CPU test)"

    def free_bytes(self) -> int:
        return 1 << 50


def samples(gbps: float) -> list[CeilingSample]:
    nbytes = 16 << 30
    return [CeilingSample(b, r, nbytes, nbytes / (gbps * 1e3)) for b in ("read-ceiling", "copy-ceiling")
            for r in range(3)]


class Stop(Exception):
    """What a time limit does to the run, in the test: it ends mid-configuration."""


@pytest.fixture
def fake_gpu(monkeypatch):
    """The GPU boundary replaced: the device, the ceilings (before, then after), the weights, the
    model, and each configuration's timing (one row per backend, its step time from the cell)."""
    import persistentkv.ceiling
    import persistentkv.measure.device
    import persistentkv.model

    phases = iter([samples(BEFORE_GBPS), samples(AFTER_GBPS)])
    monkeypatch.setattr(persistentkv.measure.device, "TorchDevice", lambda *_: FakeDevice())
    monkeypatch.setattr(persistentkv.ceiling, "measure_ceilings", lambda *a, **k: (next(phases), {}))
    monkeypatch.setattr(persistentkv.ceiling, "measure_floor",   # a matrix's one-kernel floor: 2 us + bytes at 4 TB/s
                        lambda device, nbytes, **k: argparse.Namespace(median_us=2.0 + nbytes / 4e6))
    monkeypatch.setattr(persistentkv.model, "random_weights", lambda *a, **k: object())

    class FakeModel:
        def __init__(self, shape, weights, variant, max_position):
            self.kernels = argparse.Namespace(name=variant)

    monkeypatch.setattr(persistentkv.model, "Model", FakeModel)
    monkeypatch.setattr(e2e, "_release", lambda: None)
    calls = {"cells": [], "stop_at": None}

    def run_cell(ctx, model, shape, batch_size, context, names):
        calls["cells"].append((batch_size, context))
        if calls["stop_at"] == len(calls["cells"]):
            raise Stop("time limit")
        setting = e2e.Setting(ctx.run_id, shape, ctx.dtype, ctx.page_size, "cases", ctx.seed, model.kernels.name, 0,
                              ctx.kernel_floors[shape.name], ctx.kv_dtype)
        return [setting.row(name, batch_size, [context] * batch_size, 0, repeat=0, step_us=1000.0 * batch_size,
                            attention_us=100.0, non_attention_us=1000.0 * batch_size - 100.0)
                for name in names]

    monkeypatch.setattr(e2e, "_run_cell", run_cell)
    return calls


def args(out: Path, kv_dtype="auto") -> argparse.Namespace:
    return argparse.Namespace(config=str(CONFIG), out=str(out), models="llama3_8b",
                              cases=",".join(f"{b}x{n}" for b, n in CELLS), traces="none",
                              backends="pkv-workqueue,flashinfer-tc", kernels="torch", kv_dtype=kv_dtype, quick=False)


def sidecar(out: Path) -> dict:
    (record,) = json.loads(out.with_suffix(".json").read_text()).values()
    return record


def test_a_run_stopped_mid_way_keeps_the_configurations_it_finished(tmp_path, fake_gpu):
    out = tmp_path / "e2e.parquet"
    fake_gpu["stop_at"] = 3  # the third cell never finishes
    with pytest.raises(Stop):
        e2e.measure(args(out))
    frame = pd.read_parquet(out)
    timed = frame[frame["model"] != ""]
    assert sorted(set(zip(timed["batch_size"], timed["context"]))) == CELLS[:2]
    assert sorted(timed["backend"].unique()) == ["flashinfer-tc", "pkv-workqueue"]
    record = sidecar(out)
    assert record["complete"] is False and record["configurations"] == {"done": 2, "total": 3}
    assert "Stop" in record["stopped_by"] and "time limit" in record["stopped_by"]  # what stopped it
    # the partial file's floors stand on the ceiling measured before the cases, whose rows it holds
    assert (frame.loc[frame["backend"] == "read-ceiling", "repeat"] < 3).all()
    assert timed["read_ceiling_gbps"].to_numpy() == pytest.approx(BEFORE_GBPS)
    row = timed.iloc[0]
    assert row["weight_floor_us"] == pytest.approx(row["weight_bytes"] / (BEFORE_GBPS * 1e3))
    assert row["floor_us"] == pytest.approx(row["weight_floor_us"] + row["kv_floor_us"])
    # every weight matrix's one-kernel floor, times the step's reads of it (ModelShape.step_matrices)
    from persistentkv.model import model_shape

    shape = model_shape(configuration.load_config(str(CONFIG)), "llama3_8b")
    want = sum(count * (2.0 + nbytes / 4e6) for nbytes, count in shape.step_matrices("float16").values())
    assert timed["weight_kernel_floor_us"].to_numpy() == pytest.approx(want)
    assert list(frame.columns) == list(e2e.E2E_COLUMNS)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_the_last_write_replaces_the_partial_file_with_the_whole_run(tmp_path, fake_gpu, monkeypatch):
    out = tmp_path / "e2e.parquet"
    seen = []
    real_save = e2e.PartialWriter.save

    def save(self, rows, done=1):  # what the file says after each configuration
        result = real_save(self, rows, done)
        seen.append((sidecar(out)["configurations"]["done"], len(pd.read_parquet(out).query("model != ''"))))
        return result

    monkeypatch.setattr(e2e.PartialWriter, "save", save)
    assert e2e.measure(args(out)) == 0
    assert seen == [(1, 2), (2, 4), (3, 6)]  # two backends' rows per cell, on disk after each cell
    frame = pd.read_parquet(out)
    record = sidecar(out)
    assert record["complete"] is True and record["configurations"] == {"done": 3, "total": 3}
    timed = frame[frame["model"] != ""]
    assert sorted(set(zip(timed["batch_size"], timed["context"]))) == CELLS
    # both ceilings' rows, the later renumbered after the earlier; the floors at the higher one
    reads = frame[frame["backend"] == "read-ceiling"]
    assert sorted(reads["repeat"]) == list(range(6))
    assert timed["read_ceiling_gbps"].to_numpy() == pytest.approx(AFTER_GBPS)
    assert all(math.isclose(r.kv_floor_us, r.kv_bytes / (AFTER_GBPS * 1e3)) for r in timed.itertuples())
    seed = configuration.calibration_seed(configuration.load_config(CONFIG, base_dir=ROOT))
    assert record["seeds"] == [seed]


def test_an_fp8_cache_run_says_so_in_its_rows_and_its_floors_read_one_byte_per_value(tmp_path, fake_gpu):
    from persistentkv.model import model_shape

    out = tmp_path / "e2e_fp8.parquet"
    assert e2e.measure(args(out, "float8_e4m3")) == 0
    frame = pd.read_parquet(out)
    fp8 = frame[frame["model"] != ""]
    assert set(fp8["kv_dtype"]) == {"float8_e4m3"}
    assert set(fp8["dtype"]) == {"float16"}  # the query, weights and activations keep the model's dtype
    shape = model_shape(configuration.load_config(str(CONFIG)), "llama3_8b")
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim  # one byte per K or V value
    assert (fp8["kv_bytes"] == fp8["batch_size"] * fp8["context"] * per_token).all()
    assert fp8["kv_floor_us"].to_numpy() == pytest.approx(fp8["kv_bytes"].to_numpy() / (AFTER_GBPS * 1e3))
    assert (fp8["weight_bytes"] == [shape.step_weight_bytes("float16", b) for b in fp8["batch_size"]]).all()


def test_measure_e2e_refuses_an_unknown_kv_dtype_in_one_line(tmp_path, capsys):
    from persistentkv import cli

    code = cli.main(["measure-e2e", "--out", str(tmp_path / "x.parquet"), "--kv-dtype", "float8_e5m2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--kv-dtype 'float8_e5m2' is not one of auto, float8_e4m3" in err[0]
    assert not list(tmp_path.iterdir())


def test_the_footprint_counts_an_fp8_cache_at_one_byte_per_value():
    from persistentkv.model import footprint, model_shape

    shape = model_shape(configuration.load_config(str(CONFIG)), "llama3_8b")
    fp16 = footprint(shape, "float16", 1000, 16, 4)
    fp8 = footprint(shape, "float16", 1000, 16, 4, kv_dtype="float8_e4m3")
    assert fp16.kv_cache == 2 * fp8.kv_cache == 2 * 2 * shape.num_layers * 1000 * 16 * shape.num_kv_heads * shape.head_dim
    assert (fp8.weights, fp8.workspaces) == (fp16.weights, fp16.workspaces)


def test_a_new_run_marks_the_file_partial_before_it_writes_a_row(tmp_path, fake_gpu, monkeypatch):
    """A complete file of an earlier run beside it: the new run's sidecar says partial at once,
    under the new run's id, before the first configuration's rows replace the old ones."""
    out = tmp_path / "e2e.parquet"
    assert e2e.measure(args(out)) == 0
    old_run = set(json.loads(out.with_suffix(".json").read_text()))
    fake_gpu["stop_at"] = len(fake_gpu["cells"]) + 1  # the next run stops in its first cell
    import persistentkv.ceiling

    phases = iter([samples(BEFORE_GBPS), samples(AFTER_GBPS)])
    monkeypatch.setattr(persistentkv.ceiling, "measure_ceilings", lambda *a, **k: (next(phases), {}))
    monkeypatch.setattr(persistentkv.ceiling, "measure_floor",   # a matrix's one-kernel floor: 2 us + bytes at 4 TB/s
                        lambda device, nbytes, **k: argparse.Namespace(median_us=2.0 + nbytes / 4e6))
    with pytest.raises(Stop):
        e2e.measure(args(out))
    payload = json.loads(out.with_suffix(".json").read_text())
    assert set(payload) != old_run
    (record,) = payload.values()
    assert record["complete"] is False and record["configurations"] == {"done": 0, "total": 3}


def test_every_backend_leads_a_round_in_turn():
    """The loops' order rotates each round (up to 7de5b0c the first loop led every round, and its
    first graph carried the host's launch of it): over len(names) rounds each backend leads once
    and every round holds each backend once."""
    names = ["pkv-workqueue", "flashinfer-tc", "vllm-fa3"]
    orders = [round_order(names, r) for r in range(6)]
    assert [o[0] for o in orders[:3]] == names and orders[3] == orders[0]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert round_order({"a": 1, "b": 2}, 1) == ["b", "a"] and round_order([], 3) == []



def test_each_round_queues_behind_the_spin_and_rewinds_each_loop_before_each_graph():
    """measure-e2e's rounds (persistentkv.measure.steps.time_loop_rounds): each round starts behind
    the spin, visits the loops in the rotated order, each loop rewound to its mark before each of
    its ROUND graphs; the warm-up rounds are dropped and every graph gets its own window."""
    from persistentkv.measure import steps

    log = []

    class Event:
        def record(self):
            log.append("event")
            self.t = len(log)

        def elapsed_ms(self, end):
            return (end.t - self.t) / 1e3

    class Device:
        def event(self):
            return Event()

        def queue_ahead(self, cycles):
            log.append(("spin", cycles))

        def synchronize(self):
            log.append("sync")

    class Loop:
        def __init__(self, name):
            self.name = name

        def rewind(self, mark):
            log.append(("rewind", self.name, mark))

        def replay(self, what):
            log.append((self.name, what))

    loops = {n: Loop(n) for n in ("a", "b", "c")}
    times = steps.time_loop_rounds(Device(), loops, {n: f"mark-{n}" for n in loops}, rounds=2, warmup=1)
    rounds = []
    for entry in log:
        if isinstance(entry, tuple) and entry[0] == "spin":
            rounds.append([])
        rounds[-1].append(entry)
    assert len(rounds) == 3 and all(r[0] == ("spin", steps.ROUND_QUEUE_CYCLES) and r[-1] == "sync" for r in rounds)
    for r, entries in enumerate(rounds):
        want = []
        for name in round_order(loops, r):
            for what in steps.ROUND:
                want += [("rewind", name, f"mark-{name}"), "event", (name, what), "event"]
        assert entries[1:-1] == want
    # one window per graph: its two events two log entries apart (the replay between them)
    assert times == {n: [{what: 2.0 for what in steps.ROUND}] * 2 for n in loops}
