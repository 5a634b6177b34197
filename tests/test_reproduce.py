"""persistentkv reproduce-check: the committed results against a re-measured copy, item by item."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from persistentkv import cli, reproduce
from persistentkv.errors import PKVError
from persistentkv.render import report

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "results" / "nvidia-h200"
COUNTERS = ROOT / "results" / "counters"
CONFIG = ROOT / "config" / "config.yaml"


def copy_results(dest: Path) -> Path:
    """The files reproduce-check reads, copied as results/ lays them out; the copy's hw folder."""
    hw = dest / "results" / "nvidia-h200"
    hw.mkdir(parents=True)
    for name in ("claims.json", "provenance.json"):
        shutil.copy2(REFERENCE / name, hw / name)
    shutil.copytree(COUNTERS, dest / "results" / "counters", ignore=shutil.ignore_patterns("*.svg"))
    return hw


def edit_json(path: Path, change) -> None:
    payload = json.loads(path.read_text())
    change(payload)
    path.write_text(json.dumps(payload))


def check(capsys, measured: Path, *extra: str) -> tuple[int, str, str, dict]:
    out = measured / "reproduction.json"
    code = cli.main(["reproduce-check", "--config", str(CONFIG), "--reference", str(REFERENCE),
                     "--measured", str(measured), "--out", str(out), *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err, json.loads(out.read_text()) if out.is_file() else {}


def by_item(payload: dict) -> dict:
    return {row["item"]: row for row in payload["items"]}


def test_the_committed_results_reproduce_themselves(tmp_path, capsys):
    measured = copy_results(tmp_path)
    code, out, err, payload = check(capsys, measured)
    assert code == 0, err
    assert payload["agrees"] and payload["same_gpu"] and payload["disagree"] == []
    items = by_item(payload)
    claims = json.loads((REFERENCE / "claims.json").read_text())["claims"]
    assert {f"{c['id']} {c['title']}" for c in claims} <= set(items)
    assert {"counters/ablation_buckets.parquet", "counters/ablation_splits.parquet",
            "counters/validation_cpu.parquet"} <= set(items)
    assert any(name.startswith("engine ceiling ") for name in items) and "e2e step (min ratio)" in items
    assert all(row["judged"] and row["agrees"] for row in payload["items"])
    assert payload["tolerances"] == {"ratio_rtol": 0.05, "time_rtol": 0.1}
    # one screen: a header, one line per small group's item, one per large group, a verdict
    lines = out.splitlines()
    assert len(lines) < 50 and lines[1].split() == ["item", "committed", "re-measured", "agrees"]
    assert "C1 B1 bucketed speedup" in out and "reproduced" in lines[-2]


def test_exactly_the_changed_items_disagree(tmp_path, capsys):
    measured = copy_results(tmp_path)

    def perturb(payload):
        claims = {c["id"]: c for c in payload["claims"]}
        claims["C2"]["fair"]["value"] *= 1.20          # off by 20 %: out of the 5 % tolerance
        claims["C3"]["fair"]["value"] *= 1.03          # 3 %: within it
        payload["engine"]["mid_range"][1]["ratio"] *= 0.80
        payload["engine"]["host"]["median_us"] *= 1.08  # a timing median within its 10 %
        payload["floor"]["baselines"]["verdict"] = "does not hold"   # same figures, the verdict flips

    edit_json(measured / "claims.json", perturb)
    table = measured.parent / "counters" / "ablation_splits.parquet"
    frame = pd.read_parquet(table)
    frame.loc[3, "launches"] += 1
    frame.to_parquet(table, index=False)

    code, out, _, payload = check(capsys, measured)
    assert code == 1
    case = json.loads((REFERENCE / "claims.json").read_text())["engine"]["mid_range"][1]["case"]
    flagged = {"C2 bimodal B8 speedup", f"engine {case} vs baselines", "floor baselines (median)",
               "counters/ablation_splits.parquet"}
    assert set(payload["disagree"]) == flagged
    items = by_item(payload)
    assert items["C2 bimodal B8 speedup"]["rel_diff"] == pytest.approx(0.20, rel=1e-4)
    assert items["C3 uniform B8 speedup"]["agrees"] and items["engine host loop (median us)"]["agrees"]
    assert "verdict holds -> does not hold" in items["floor baselines (median)"]["note"]
    assert "column launches, row 3" in items["counters/ablation_splits.parquet"]["note"]
    assert payload["counts"]["disagree"] == 4 and not payload["agrees"]
    for name in flagged:
        assert any(line.lstrip().startswith(name) and line.rstrip().endswith("NO") for line in out.splitlines()), name
    # --exit-zero (the workflow's rule) writes the same file and leaves the verdict to it
    code, _, _, again = check(capsys, measured, "--exit-zero")
    assert code == 0 and again["disagree"] == payload["disagree"]


def test_a_different_gpu_is_reported_not_judged_but_counters_are(tmp_path, capsys):
    measured = copy_results(tmp_path)
    edit_json(measured / "provenance.json",
              lambda runs: [run.update(gpu="NVIDIA H100 80GB HBM3") for run in runs.values()])
    edit_json(measured / "claims.json", lambda payload: payload["claims"][0]["fair"].update(value=9.0))

    code, out, _, payload = check(capsys, measured)
    assert code == 0, out
    assert not payload["same_gpu"] and payload["measured"]["gpu"] == "NVIDIA H100 80GB HBM3"
    items = by_item(payload)
    c1 = items["C1 B1 bucketed speedup"]
    assert not c1["judged"] and c1["agrees"] is None and c1["note"] == reproduce.DIFFERENT_GPU
    assert c1["measured"]["value"] == 9.0
    hardware = [row for row in payload["items"] if row["hardware"]]
    assert hardware and not any(row["judged"] for row in hardware)
    independent = [row["item"] for row in payload["items"] if row["judged"]]
    assert "C6 launch fan-out" in independent and "C7 merge-state traffic" in independent
    assert "counters/validation_cpu.parquet" in independent
    assert reproduce.DIFFERENT_GPU in out

    table = measured.parent / "counters" / "validation_cpu.parquet"
    frame = pd.read_parquet(table)
    frame.loc[0, "rel_err"] *= 2
    frame.to_parquet(table, index=False)
    code, _, _, payload = check(capsys, measured)
    assert code == 1 and payload["disagree"] == ["counters/validation_cpu.parquet"]


def test_a_missing_item_or_table_disagrees(tmp_path, capsys):
    measured = copy_results(tmp_path)
    edit_json(measured / "claims.json", lambda payload: payload["engine"]["ceiling"].pop(0))
    (measured.parent / "counters" / "ablation_buckets.parquet").unlink()
    code, _, _, payload = check(capsys, measured)
    assert code == 1 and len(payload["disagree"]) == 2
    assert by_item(payload)["counters/ablation_buckets.parquet"]["note"] == "missing from the re-measured results"


@pytest.mark.parametrize("damage, message", [
    ("no folder", "results folder"),
    ("malformed claims", "cannot read"),
    ("no claims", "claims.json is missing"),
    ("no claims list", "claims.json has no claims list"),
    ("a case without its name", "is not a claims.json this version reads: KeyError"),
    ("unreadable counters", "cannot read"),
])
def test_bad_input_is_one_line(tmp_path, capsys, damage, message):
    measured = copy_results(tmp_path)
    if damage == "no folder":
        shutil.rmtree(measured)
    elif damage == "malformed claims":
        (measured / "claims.json").write_text("{not json")
    elif damage == "no claims":
        (measured / "claims.json").unlink()
    elif damage == "no claims list":
        (measured / "claims.json").write_text("{}")
    elif damage == "a case without its name":
        edit_json(measured / "claims.json", lambda payload: payload["engine"]["mid_range"][0].pop("case"))
    else:
        (measured.parent / "counters" / "validation_cpu.parquet").write_bytes(b"not parquet")
    code, out, err, _ = check(capsys, measured)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and message in err
    assert "Traceback" not in err and not (measured / "reproduction.json").exists()


def test_the_tolerances_come_from_the_config(tmp_path, capsys):
    config = yaml.safe_load(CONFIG.read_text())
    config["reproduce"]["ratio_rtol"] = 0.25
    loose = tmp_path / "loose.yaml"
    loose.write_text(yaml.safe_dump(config))
    measured = copy_results(tmp_path)
    edit_json(measured / "claims.json", lambda payload: payload["claims"][1]["fair"].update(
        value=payload["claims"][1]["fair"]["value"] * 1.2))
    out = measured / "reproduction.json"
    code = cli.main(["reproduce-check", "--config", str(loose), "--reference", str(REFERENCE),
                     "--measured", str(measured), "--out", str(out)])
    assert code == 0 and json.loads(out.read_text())["tolerances"]["ratio_rtol"] == 0.25

    del config["reproduce"]
    loose.write_text(yaml.safe_dump(config))
    code = cli.main(["reproduce-check", "--config", str(loose), "--measured", str(measured)])
    assert code == 2 and "no reproduce section" in capsys.readouterr().err
    with pytest.raises(PKVError, match="no reproduce section"):
        reproduce.Tolerances.from_config({})


def test_tables_equal_cell_for_cell():
    frame = pd.DataFrame({"a": [1, 2], "b": [0.5, float("nan")]})
    assert reproduce.table_difference(frame, frame.copy()) == ""
    assert "row 1" in reproduce.table_difference(frame, frame.assign(b=[0.5, 1.0]))
    assert "dtype" in reproduce.table_difference(frame, frame.assign(a=[1.0, 2.0]))
    assert "rows" in reproduce.table_difference(frame, frame.iloc[:1])
    assert "columns" in reproduce.table_difference(frame, frame[["b", "a"]])


def test_the_report_shows_the_table_only_with_a_reproduction(tmp_path, capsys):
    measured = copy_results(tmp_path)
    edit_json(measured / "claims.json", lambda payload: payload["claims"][1]["fair"].update(value=5.0))
    check(capsys, measured)
    payload = report.read_reproduction(measured)
    template = report.environment().get_template("reproduction.html.j2")
    html = template.render(reproduction=report.reproduction_context(payload))
    assert 'id="reproduction"' in html and "does not reproduce" in html
    assert "C2 bimodal B8 speedup" in html and "5.000 holds" in html and "within 5 %" in html
    assert template.render(reproduction=report.reproduction_context(None)).strip() == ""
    assert report.read_reproduction(tmp_path) is None
    assert '{% include "reproduction.html.j2" %}' in (report.TEMPLATES / "report.html.j2").read_text()
    (measured / "reproduction.json").write_text("[]")
    with pytest.raises(PKVError, match="is not a persistentkv-reproduction/1 file"):
        report.read_reproduction(measured)
