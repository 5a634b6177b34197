"""The full decode step in the renderers: the report's section, the paper's table and macros and the
figure, from synthetic e2e rows (clearly labelled as such) and without any."""

from __future__ import annotations

import re

import pytest

import synthetic
from persistentkv import claims, targets
from persistentkv.errors import PKVError
from persistentkv.render import figures, report, tables
from persistentkv.results import load_results


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """(results, claims payload, report html) for synthetic results with e2e rows, and without."""
    out = {}
    for name, e2e in (("with", True), ("without", False)):
        root = tmp_path_factory.mktemp(f"e2e-{name}")
        hw_dir = synthetic.write_results(root, e2e=e2e)
        results = load_results(hw_dir, root / "results" / "counters", synthetic.config())
        payload = claims.judge(results)
        figures.render_all(results, root / "figures", "svg")
        html = report.render(payload, results, root / "figures", root / "report.html").read_text()
        out[name] = (results, payload, html, root)
    return out


def section(html: str) -> str:
    start = html.index('<section id="e2e">')
    return html[start:html.index("</section>", start)]


def test_the_report_has_the_full_decode_step_section_with_every_cell(rendered):
    results, payload, html, _ = rendered["with"]
    part = section(html)
    e2e = payload["e2e"]
    assert e2e["measured"] and e2e["cells"]
    assert 'data-figure="e2e"' in part and html.count('data-figure="e2e"') == 1
    table = part.split('id="e2e-cells"', 1)[1].split("</table>")[0]
    rows = re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td>", table)
    assert [where for where, _ in rows] == [c["where"] for c in e2e["cells"]]
    assert [best for _, best in rows] == [c["baseline"] for c in e2e["cells"]]
    assert re.findall(r'<tr class="group"><th colspan="12">(\S+) \((\w+) kernels\)', table) == \
        list(dict.fromkeys((c["model"], c["kernels"]) for c in e2e["cells"]))
    first = e2e["cells"][0]
    assert f"{first['our_step_us']:.0f}" in part and f"{first['amdahl']:.3f}×" in part
    for sentence in e2e["sentences"]:
        assert sentence.replace("'", "&#39;") in part
    # rows that did not run are listed with their reason, and the config's note on the shard is there
    assert "synthetic: needs more memory than the toy device has" in part and 'id="e2e-not-run"' in part
    assert "llama3_70b_tp8: synthetic: one GPU&#39;s shard" in part
    assert "not a prefill" in part and "not measured on" not in part
    # the synthetic run is two passes (two run_ids, two files): every cell is judged over them
    assert len(e2e["run_ids"]) == synthetic.E2E_PASSES == 2
    assert sorted(k for k in results.found if k.startswith("e2e/")) == ["e2e/pass1", "e2e/pass2"]
    assert {c["interval"] for c in e2e["cells"]} == {"passes"} and all(c["passes"] == 2 for c in e2e["cells"])
    assert "2 independent passes" in " ".join(e2e["sentences"]) and "independent passes (one process each)" in part


def test_without_rows_the_section_says_not_measured(rendered):
    results, payload, html, root = rendered["without"]
    part = section(html)
    assert results.e2e.empty and not payload["e2e"]["measured"]
    assert f"The full decode step: not measured on {results.hw} yet." in part
    assert 'id="e2e-cells"' not in part and 'data-figure="e2e"' in part  # the figure is its placeholder
    assert f"not measured on {results.hw} yet" in (root / "figures" / "e2e.svg").read_text()


def test_a_partial_run_is_marked_in_the_report(tmp_path):
    hw_dir = synthetic.write_results(tmp_path)
    synthetic.write_e2e(hw_dir, complete=False)
    results = load_results(hw_dir, tmp_path / "results" / "counters", synthetic.config())
    payload = claims.judge(results)
    figures.render_all(results, tmp_path / "figures", "svg", only=None)
    html = report.render(payload, results, tmp_path / "figures", tmp_path / "report.html").read_text()
    assert payload["e2e"]["complete"] is False
    assert "Partial run:" in section(html)


def test_a_run_in_the_layout_before_passes_is_refused_with_where_to_move_it(tmp_path):
    hw_dir = synthetic.write_results(tmp_path)
    (hw_dir / "e2e" / "pass1.parquet").rename(hw_dir / "e2e.parquet")
    with pytest.raises(PKVError, match=r"e2e.parquet is a full decode step run in the layout before passes; "
                                       r"move it to .*e2e/pass1.parquet"):
        load_results(hw_dir, tmp_path / "results" / "counters", synthetic.config())


def test_the_paper_table_and_macros_come_from_the_verdicts(rendered, tmp_path):
    results, payload, _, _ = rendered["with"]
    tables.render(payload, results, tmp_path)
    table = (tmp_path / "tables" / "e2e.tex").read_text()
    cells = payload["e2e"]["cells"]
    assert table.count(r"\\") - 2 == len(cells)  # the two header lines, then one line per cell
    assert tables.tex(cells[0]["label"]) in table and f"{cells[0]['ratio']:.3f}" in table
    macros = dict((n, v) for n, v, _ in tables.macros(payload, results))
    assert macros["pkvEtoeStepFloor"] == f"{targets.E2E_STEP_MIN_RATIO:g}"
    assert macros["pkvEtoeCells"] == str(len(cells))
    step, gain = payload["e2e"]["step"], payload["e2e"]["gain"]
    assert macros["pkvEtoeStepVerdict"] == ("holds" if step["holds"] else "does not hold")
    assert macros["pkvEtoeGainReached"] == str(gain["reached"])
    assert macros["pkvEtoeMinRatio"] == tables.tex_ratio(step["min"]["ratio"])
    empty, none_payload, _, _ = rendered["without"]
    tables.render(none_payload, empty, tmp_path / "none")
    assert "not measured on" in (tmp_path / "none" / "tables" / "e2e.tex").read_text()
    none = dict((n, v) for n, v, _ in tables.macros(none_payload, empty))
    assert none["pkvEtoeCells"] == tables.NM and none["pkvEtoeStepVerdict"] == "not measured"


def test_the_figure_data_is_the_rows_medians_and_the_verdicts_intervals(rendered):
    results, payload, _, _ = rendered["with"]
    split = figures.data_e2e_split(results)
    ok = results.e2e[(results.e2e["status"] == "ok") & (results.e2e["model"] != "")]
    mine = ok[(ok["model"] == "llama3_8b") & (ok["batch_size"] == 16) & (ok["context"] == 4096)
              & (ok["backend"] == "flashinfer-tc")]
    row = split[(split["model"] == "llama3_8b") & (split["cell"] == "B=16 x 4K") & (split["backend"] == "flashinfer-tc")]
    assert float(row["step_us"].iloc[0]) == pytest.approx(mine["step_us"].median())
    assert float(row["rest_us"].iloc[0]) == pytest.approx(mine["step_us"].median() - mine["attention_us"].median())
    assert "trtllm-xqa" not in set(split["backend"])  # unavailable: no bar
    gain = figures.data_e2e_gain(results)
    assert list(gain["ratio"]) == [c["ratio"] for c in payload["e2e"]["cells"]]
    assert list(gain["amdahl_lo"]) == [c["amdahl_lo"] for c in payload["e2e"]["cells"]]


def test_the_figure_adds_each_models_fp8_panels_where_the_fp8_step_was_measured(tmp_path, rendered):
    """Synthetic FP8 passes (the fp16 rows relabelled kv_dtype float8_e4m3 and made 20 % faster):
    the figure's data gains the FP8 cache's rows and cells beside the fp16 ones, judged by the same
    verdicts over the FP8 passes, and the figure titles the FP8 panels; without them nothing changes."""
    from dataclasses import replace

    from persistentkv import io
    from persistentkv.names import FP8_KV

    hw_dir = synthetic.write_results(tmp_path, e2e=True)
    for n in range(1, synthetic.E2E_PASSES + 1):
        frame = synthetic.e2e_frame(seed=3 + n, run_id=f"{synthetic.E2E_RUN_ID}-fp8-{n}")
        frame = frame.assign(kv_dtype=FP8_KV, step_us=frame["step_us"] * 0.8, attention_us=frame["attention_us"] * 0.8)
        io.atomic_write_parquet(hw_dir / "e2e_fp8" / f"pass{n}.parquet", frame)
        io.atomic_write_json(hw_dir / "e2e_fp8" / f"pass{n}.json",
                             synthetic.e2e_provenance(True, f"{synthetic.E2E_RUN_ID}-fp8-{n}"))
    results = load_results(hw_dir, tmp_path / "results" / "counters", synthetic.config())
    split, gain = figures.data_e2e_split(results), figures.data_e2e_gain(results)
    assert set(split["cache"]) == set(gain["cache"]) == {"", FP8_KV}
    fp16 = split[split["cache"] == ""].drop(columns="cache").reset_index(drop=True)
    fp8 = split[split["cache"] == FP8_KV].drop(columns="cache").reset_index(drop=True)
    assert fp8[["model", "cell", "backend"]].equals(fp16[["model", "cell", "backend"]])
    assert fp8["step_us"].to_numpy() == pytest.approx(0.8 * fp16["step_us"].to_numpy())
    judged = targets.e2e_verdicts(replace(results, e2e=results.e2e_fp8))["cells"]
    assert list(gain.loc[gain["cache"] == FP8_KV, "ratio"]) == [c["ratio"] for c in judged]
    figures.render_all(results, tmp_path / "figures", "svg", only=["e2e"])
    svg = (tmp_path / "figures" / "e2e.svg").read_text()
    for model in synthetic.E2E_MODELS:
        assert f"{model} (torch kernels) over an FP8 e4m3 cache" in svg
    without, _, _, _ = rendered["with"]
    assert set(figures.data_e2e_split(without)["cache"]) == {""} and without.e2e_fp8.empty
