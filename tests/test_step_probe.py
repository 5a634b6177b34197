"""The CPU side of benchmarks/step_probe.py: its backend specs and the per-layer-call timeline
that part ctas builds from the traced module's records (the records as trace_cta decodes them)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import step_probe  # noqa: E402
import trace_cta  # noqa: E402
from test_trace_cta import record  # noqa: E402


def test_backend_specs_take_several_int_options():
    plain = step_probe.backend_of("pkv-workqueue")
    assert plain.name == "pkv-workqueue" and plain.warps == "auto" and plain.options == {}
    two = step_probe.backend_of("pkv-workqueue:warps=4+target_items=528")
    assert two.warps == 4 and two.options == {"target_items": 528}
    assert step_probe.backend_of("pkv-workqueue:warps=8").engine_options == {"warps": 8}
    with pytest.raises(ValueError):
        step_probe.backend_of("pkv-workqueue:warps=eight")


def layer_calls(layers=3, gap=4_000):
    """Records of ``layers`` layer calls of two CTAs on SMs 5 and 6 (tokens 100 and 300): call k's
    first CTA enters at k * 20_000 ns, releases 500 later, lands its first stage 1000 after the
    release, CTA i ends its loop 6000 + 2000 i after the release and exits 700 after that."""
    recs = []
    for k in range(layers):
        entry = k * 20_000 + gap
        rel = entry + 500
        for i in range(2):
            loop = rel + 6_000 + 2_000 * i
            ns = [entry + 10 * i, rel + 10 * i, rel + 1_000, loop, loop + 200, loop + 400, loop + 700]
            recs.append(record(ns, sm=5 + i, block=i, slot=i, merged=i, tokens=100 + 200 * i))
    df = trace_cta.records_frame(np.stack(recs), items=2, case="c", warps=0)
    t0 = df.ns_entry.min()
    for c in [c for c in df.columns if c.startswith("ns_")]:
        df[c] = df[c] - t0
    return df


def test_cta_calls_time_each_layer_call_from_its_first_entry():
    table = step_probe._cta_calls(layer_calls(), "c pkv-workqueue", "in-step", 0)
    assert table["call"].tolist() == [0, 1, 2] and set(table["items"]) == {2} and set(table["sms"]) == {2}
    assert np.isnan(table["before"][0])  # nothing before the first call
    # call k's first entry minus call k-1's last exit: 20000 - (500 + 8000 + 700)
    assert table["before"][1:].tolist() == pytest.approx([10.8, 10.8])
    assert table["span"].tolist() == pytest.approx([9.2] * 3)      # first entry to last exit
    assert table["release"].tolist() == pytest.approx([0.5] * 3)
    assert table["first"].tolist() == pytest.approx([1.0] * 3)  # both land 1000 ns past the call's release
    assert table["loop"].tolist() == pytest.approx([8.0] * 3) and table["spread"].tolist() == pytest.approx([2.0] * 3)
    assert table["tail"].tolist() == pytest.approx([0.7] * 3) and table["skew"].tolist() == pytest.approx([0.01] * 3)
    # the last CTA to exit is on SM 6, the most loaded (300 tokens against a mean of 200)
    assert set(table["last_sm_tokens"]) == {300.0} and set(table["max_sm_tokens"]) == {300.0}
    assert set(table["mean_sm_tokens"]) == {200.0}
    # tokens per us of each CTA's loop (first stage landed to loop end): 100 / 5.0 and 300 / 7.0
    assert table["cta_tokens_per_us"].tolist() == pytest.approx([np.median([20.0, 300 / 7.0])] * 3)


def test_each_cell_loop_frees_a_cells_loops_before_the_next_cell_is_built(monkeypatch):
    import weakref

    torch = pytest.importorskip("torch", reason="each_cell_loop runs under torch.no_grad")

    class Loop:
        pass

    built, seen, alive_at_build = [], [], []

    def loops_of(model_name, where, backends):
        alive_at_build.append([r() is not None for r in built])  # the earlier cells' loops, when this one is built
        loops = {b: Loop() for b in backends}
        built.extend(weakref.ref(loop) for loop in loops.values())
        return f"shape-{model_name}", object(), object(), loops

    monkeypatch.setattr(step_probe, "loops_of", loops_of)
    monkeypatch.setattr(step_probe.build, "cache", {"llama3_70b_tp8": "weights", "llama3_8b": "weights"})

    def body(label, backend, shape, loop):
        seen.append((label, backend, shape, torch.is_grad_enabled(), isinstance(loop, Loop),
                     sorted(step_probe.build.cache)))

    step_probe.each_cell_loop([("8b", "bimodal_b8@24"), ("8b", (4, 32768))], ["pkv-workqueue", "flashinfer-tc"], body)
    model = step_probe.MODEL_KEYS["8b"]
    assert [s[:3] for s in seen] == [("8b:bimodal_b8@24", "pkv-workqueue", f"shape-{model}"),
                                     ("8b:bimodal_b8@24", "flashinfer-tc", f"shape-{model}"),
                                     ("8b:4x32768", "pkv-workqueue", f"shape-{model}"),
                                     ("8b:4x32768", "flashinfer-tc", f"shape-{model}")]
    assert all(not grad and is_loop for _, _, _, grad, is_loop, _ in seen)   # autograd off in the body
    assert all(cache == [model] for *_, cache in seen)                       # the other model's weights went
    assert alive_at_build == [[], [False, False]] and all(r() is None for r in built)


def test_summarize_dev_prints_part_paired_per_round_ratios(capsys):
    """Part paired's rows: every backend's step in the same rounds; summarize_dev prints their
    medians and each backend's per-round ratio to the first one's (the median of the ratios,
    not the ratio of the medians)."""
    import pandas as pd

    import summarize_dev

    rows = []
    for r, (a, b) in enumerate([(100.0, 90.0), (200.0, 190.0), (300.0, 300.0)]):
        for variant, us in (("A", a), ("B", b)):
            rows.append(dict(part="paired", cell="8b:1x4096", variant=variant, name="step", repeat=r, us=us))
            rows.append(dict(part="paired", cell="8b:1x4096", variant=variant, name="alone", repeat=r, us=us / 10))
    summarize_dev.print_step_probe(Path("step_probe_paired_x.parquet"), pd.DataFrame(rows))
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("8b:1x4096") and "0.95" in ln)
    # per-round ratios B / A: 0.9, 0.95, 1.0 -> median 0.95 (the medians' ratio would be 190/200)
    assert line.split()[1:] == ["200.0", "190.0", "0.95"]
    assert "attention alone" in out


def test_rotated_rounds_lead_with_each_graph_in_turn():
    """Each graph leads once every len(order) rounds and every round holds each graph once."""
    order = ["a", "b", "c"]
    assert [step_probe.round_order(order, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert order == ["a", "b", "c"]                      # the caller's list is left as it was
