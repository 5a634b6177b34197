"""Figures, LaTeX tables and macros, the HTML report, and the rendering commands."""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import synthetic
from persistentkv import claims, cli, io
from persistentkv.errors import PKVError
from persistentkv.commands.claims import judged
from persistentkv.render import FIGURE_NAMES, TABLE_NAMES, figures, report, tables
from persistentkv.results import load_results

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Synthetic results (clearly labelled as such, an FP8 grid among them) plus their claims."""
    root = tmp_path_factory.mktemp("syn")
    hw_dir = synthetic.write_results(root, fp8=True)
    results = load_results(hw_dir, root / "results" / "counters", synthetic.config())
    return root, results, judged(results)  # claims.json's payload, the floor's and FP8's entries included


@pytest.fixture(scope="module")
def empty(tmp_path_factory):
    root = tmp_path_factory.mktemp("empty")
    results = load_results(root / "results" / "nvidia-h200", root / "results" / "counters", synthetic.config())
    return root, results, claims.judge(results)


def svg_text(fig) -> str:
    import io

    buf = io.StringIO()
    with figures.style():                      # text stays text (svg.fonttype none), as save() writes it
        fig.savefig(buf, format="svg")
    return buf.getvalue()


def test_every_figure_renders_from_data(measured, tmp_path):
    _, results, _ = measured
    written = figures.render_all(results, tmp_path, "svg")
    assert [p.stem for p in written] == list(FIGURE_NAMES)
    for path in written:
        text = path.read_text()
        assert text.startswith("<?xml") and "<svg" in text
        assert "not measured" not in text, f"{path.name} fell back to a placeholder with data present"


def test_missing_data_renders_placeholders_that_say_so(empty, tmp_path):
    _, results, _ = empty
    for spec in figures.FIGURES:
        text = svg_text(spec.build(results))
        assert "not measured on nvidia-h200 yet" in text or "not computed yet" in text, spec.name


@pytest.mark.parametrize("fmt", ["svg", "pdf"])
def test_figures_are_byte_stable(measured, tmp_path, fmt):
    """Rendered twice, every figure is the same bytes: no date, no random id (a rerun of the
    pipeline leaves the committed figures untouched)."""
    import time

    _, results, _ = measured
    a = figures.render_all(results, tmp_path / "a", fmt)
    time.sleep(1.1)                       # a timestamp to the second would differ now
    b = figures.render_all(results, tmp_path / "b", fmt)
    for x, y in zip(a, b):
        assert x.read_bytes() == y.read_bytes(), x.name
    text = a[0].read_bytes()
    assert b"CreationDate" not in text and b"<dc:date>" not in text


def tick_overlaps(fig) -> list[str]:
    """Pairs of visible tick labels on one log axis of ``fig`` whose boxes overlap once drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    out = []
    for ax in fig.axes:
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            if axis.get_scale() != "log":
                continue
            labels = [t for t in axis.get_ticklabels(which="both") if t.get_visible() and t.get_text()]
            boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels]
            for i, (ta, a) in enumerate(boxes):
                for tb, b in boxes[i + 1:]:
                    if a.overlaps(b) and a.intersection(a, b).width * a.intersection(a, b).height > 1:
                        out.append(f"{ax.get_title() or '?'} {name}: {ta!r} / {tb!r}")
    return out


def test_no_figure_has_crowded_tick_labels(measured):
    _, results, _ = measured
    for spec in figures.FIGURES:
        with figures.style():
            assert tick_overlaps(spec.build(results)) == [], spec.name


@pytest.mark.slow
@pytest.mark.skipif(not (REPO / "results" / "nvidia-h200" / "raw").is_dir(), reason="no committed H200 rows")
def test_committed_figures_have_no_crowded_tick_labels():
    """The committed H200 rows span 0.07-30x on the trace figure and under a decade of errors on
    the validation figure, where the labels used to run together."""
    from persistentkv.configuration import load_config

    results = load_results(REPO / "results" / "nvidia-h200", REPO / "results" / "counters",
                           load_config(REPO / "config" / "config.yaml"))
    for spec in figures.FIGURES:
        with figures.style():
            assert tick_overlaps(spec.build(results)) == [], spec.name


def test_log_axes_keep_their_labels_apart():
    """A ratio axis over 0.07-30 (the published protocol's range) and a short log axis
    (relative errors 2e-4-2e-3): labels readable and apart, at 1, 2, 5 x 10^k or plain ratios."""
    from matplotlib.figure import Figure

    with figures.style():
        fig = Figure(figsize=(3.4, 3.0), layout="constrained")
        left, right = fig.subplots(1, 2)
        left.plot([0, 1], [0.07, 30])
        figures.ratio_axis(left)
        right.plot([2e-4, 2.2e-3], [0, 1])
        figures.log_axis(right, "x")
        assert tick_overlaps(fig) == []
        assert [t.get_text() for t in left.get_yticklabels()] == ["0.1", "0.3", "1", "3", "10", "30"]
        shown = [t.get_text() for t in right.get_xticklabels() if t.get_text()]
        assert {"5e-4", "1e-3", "2e-3"} <= set(shown)
        assert not [t for t in right.xaxis.get_ticklabels(minor=True) if t.get_text()]
    assert figures.ratio_ticks(0.8, 1.6) == [0.8, 0.9, 1.0, 1.25, 1.5]


def test_validation_tells_the_dtypes_apart_with_their_own_tolerance(measured):
    """Each cache dtype has its panel (and its report rows) with its own tolerance: float16's is
    2e-3, bfloat16's 1e-2; the CPU executor's rows, float16, sit in the float16 panel."""
    _, results, _ = measured
    frame = figures.data_validation(results)
    assert set(frame["dtype"]) == {"float16", "bfloat16"}
    assert set(frame.loc[frame["source"] == "cpu", "dtype"]) == {"float16"}
    fig = figures.fig_validation(frame, results.hw)
    assert [ax.get_title() for ax in fig.axes] == ["float16 (tolerance 0.002)", "bfloat16 (tolerance 0.01)"]
    rows = {(r["backend"], r["dtype"]): r for r in report.validation_rows(results)}
    assert rows[("pkv-workqueue", "float16")]["rtol"] == "2.0e-03"
    assert rows[("pkv-workqueue", "bfloat16")]["rtol"] == "1.0e-02"
    assert rows[("cpu:workqueue", "float16")]["rtol"] == "2.0e-03" and ("cpu:workqueue", "bfloat16") not in rows


def test_validation_shows_the_gated_metric_and_marks_older_rows():
    """The figure and the report show the worst (row, head) error (max_row_head_err); GPU rows
    recorded before that column existed fall back to their whole-batch rel_err, marked as such."""
    import types

    import pandas as pd

    gpu = synthetic.validation_frame().drop(columns=["max_row_head_err", "worst_row", "worst_head",
                                                     "row_heads_failing"])
    cpu = synthetic.ablation_frames()["validation_cpu"]
    results = types.SimpleNamespace(validation_gpu=gpu, validation_cpu=cpu, hw="toy")
    frame = figures.data_validation(results)
    old = frame[frame["source"] == "gpu"]
    new = frame[frame["source"] == "cpu"]
    assert old.loc[old["status"] == "ok", "whole_batch"].all() and not new["whole_batch"].any()
    np.testing.assert_array_equal(old["err"].dropna(), old["rel_err"].dropna())
    np.testing.assert_array_equal(new["err"], new["max_row_head_err"])
    fig = figures.fig_validation(frame, "toy")
    assert fig.axes[0].get_xlabel() == "worst (row, head) ‖out − ref‖ / ‖ref‖ (log)"
    assert "○ = whole-batch" in fig._suptitle.get_text()
    rows = {(r["backend"], r["dtype"]): r for r in report.validation_rows(results)}
    assert rows[("pkv-workqueue", "float16")]["worst"].endswith(" (whole batch)")
    assert rows[("cpu:workqueue", "float16")]["worst"] == f"{new['max_row_head_err'].max():.1e}"   # printed at io.PRECISION['error']'s 2 digits
    current = types.SimpleNamespace(validation_gpu=synthetic.validation_frame(), validation_cpu=pd.DataFrame(),
                                    hw="toy")
    frame = figures.data_validation(current)
    assert not frame["whole_batch"].any()
    assert "○" not in figures.fig_validation(frame, "toy")._suptitle.get_text()


def test_recorded_reasons_read_as_sentences():
    """A reason recorded from an exception shows its message, not the exception's class."""
    assert report.reader_text("PKVError: backend adaptive needs a policy file (policy_path); pass --policy") == \
        "backend adaptive needs a policy file (policy_path); pass --policy"
    assert report.reader_text("persistentkv.errors.PKVError: x") == "x"
    assert report.reader_text("ModuleNotFoundError: No module named 'vllm'") == "No module named 'vllm'"
    assert report.reader_text("synthetic: torch-sdpa skipped") == "synthetic: torch-sdpa skipped"
    assert report.reader_text("needs sm_90 (ValueError: no)") == "needs sm_90 (ValueError: no)"


def test_provenance_says_once_what_every_run_shares():
    rows = [{"run_id": "a", "gpu": "H200", "sm_count": 132, "driver": "580", "torch": "2.11", "cuda": "13.0"},
            {"run_id": "b", "gpu": "H200", "sm_count": 132, "driver": "580", "torch": "2.12", "cuda": "13.0"}]
    shared, varying = tables.machine_columns(rows)
    assert shared == [("GPU", "H200 (132 SMs)"), ("driver", "580"), ("CUDA", "13.0")]
    assert varying == [("torch", "torch")]


def test_the_report_counts_the_builds_its_runs_come_from(measured, tmp_path):
    rows = [{"run_id": "a", "git_commit": "a66ff0e1234567"}, {"run_id": "b", "git_commit": "93b85f3de9"},
            {"run_id": "c", "git_commit": "a66ff0e1234567"}, {"run_id": "d", "git_commit": "a66ff0e", "git_dirty": True},
            {"run_id": "e"}]
    assert tables.commit_counts(rows) == [("a66ff0e123", 2), ("93b85f3de9", 1), ("?", 1), ("a66ff0e+dirty", 1)]
    assert tables.commit_counts(rows[:1]) == [("a66ff0e123", 1)]
    from dataclasses import replace

    def builds(results, payload, where):
        html = render_report(where, results, payload)
        text = html[html.index('id="builds"'):]
        return text[:text.index("</p>")]

    _, results, payload = measured
    (commit,) = {str(p["git_commit"])[:10] for p in results.provenance.values()}  # the synthetic runs: one build
    assert f"Every run comes from one build, commit <code>{commit}</code>." in builds(results, payload, tmp_path / "a")
    prov = next(iter(results.provenance.values()))
    two = replace(results, provenance={**results.provenance, "other-run": {**prov, "git_commit": "0123456789abc"}})
    text = builds(two, payload, tmp_path / "b")
    assert f"The runs come from 2 builds: <code>{commit}</code> ({len(results.provenance)} run" in text
    assert "<code>0123456789</code> (1 run)." in text


def test_pdf_and_bad_format(measured, tmp_path):
    _, results, _ = measured
    (path,) = figures.render_all(results, tmp_path, "pdf", only=["fanout_merge"])
    assert path.read_bytes().startswith(b"%PDF")
    with pytest.raises(PKVError, match="format 'gif'"):
        figures.render_all(results, tmp_path, "gif")
    with pytest.raises(PKVError, match="unknown figure 'nope'"):
        figures.render_all(results, tmp_path, "svg", only=["nope"])


def test_trace_ratio_data_matches_claims(measured):
    _, results, payload = measured
    frame = figures.data_trace_ratios(results)
    c1 = next(c for c in payload["claims"] if c["id"] == "C1")
    row = frame[(frame["protocol"] == "step") & (frame["trace"] == "bucketed_b1") & (frame["backend"] == "pkv-buckets")]
    assert row["ratio"].iloc[0] == pytest.approx(c1["fair"]["value"])


def test_split_sensitivity_is_relative_to_each_routes_best_split(measured):
    # synthetic.py: pkv-split's time grows 4 % per doubling of S away from S = 16
    data = figures.data_split_times(measured[1])
    assert not data.empty and set(data["route"]) == {"pkv-split"} and data["protocol"].iloc[0] == "step"
    by_s = data.set_index("num_splits")["ratio"]
    assert by_s[16] == pytest.approx(1.0)
    for s in (8, 32):
        assert by_s[s] == pytest.approx(1 / 1.04, rel=1e-6)
    assert by_s[4] == pytest.approx(1 / 1.08, rel=1e-6) and by_s[64] == pytest.approx(1 / 1.08, rel=1e-6)
    assert (data["lo"] <= data["ratio"] + 1e-12).all() and (data["ratio"] <= data["hi"] + 1e-12).all()


def test_tex_escaping():
    assert tables.tex("a_b & 50% #1 {x}") == r"a\_b \& 50\% \#1 \{x\}"
    assert tables.tex("1.2× → ρ") == r"1.2$\times$ $\to$ $\rho$"
    assert tables.tex(None) == tables.NM
    assert tables.tex("n/m") == tables.NM
    with pytest.raises(PKVError, match="no LaTeX spelling"):
        tables.tex("日本")


def macro_map(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\\newcommand\{\\(\w+)\}\{(.*)\}( %.*)?$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def test_tables_and_macros_from_measured(measured, tmp_path):
    _, results, payload = measured
    written = tables.render(payload, results, tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == sorted(
        ["macros.tex"] + [f"tables/{t}.tex" for t in TABLE_NAMES])
    m = macro_map(tmp_path / "macros.tex")
    names = list(m)
    assert len(names) == len(set(names)) and all(re.fullmatch(r"pkv[A-Za-z]+", n) for n in names)
    c1 = payload["claims"][0]
    assert m["pkvClaimOneRatioFair"] == f"{c1['fair']['value']:.3f}$\\times$"
    assert m["pkvClaimOneVerdict"] == tables.tex(c1["verdict"])
    assert m["pkvGPU"] == tables.tex(synthetic.GPU)
    # the run's ceiling (its 16 GiB rate), not a median of both sizes' sample rates
    assert tables.read_ceiling_gbps(results) == pytest.approx(synthetic.RUN_CEILING_GBPS)
    rc = results.ceilings[results.ceilings["backend"] == "read-ceiling"]
    pooled = float((rc["kv_bytes"] / rc["per_layer_us"] / 1e3).median())
    assert abs(pooled - synthetic.RUN_CEILING_GBPS) > 10
    assert m["pkvReadCeiling"] == f"{synthetic.RUN_CEILING_GBPS:,.0f}".replace(",", "{,}")
    for c in payload["claims"]:
        assert f"pkvClaim{c['word']}Sentence" in m
    claims_tex = (tmp_path / "tables" / "claims.tex").read_text()
    assert claims_tex.count(r"\\") == len(claims.CLAIMS) + 1      # header + one row per claim
    assert tables.NM not in claims_tex


def test_macros_when_nothing_is_measured(empty, tmp_path):
    _, results, payload = empty
    tables.render(payload, results, tmp_path)
    m = macro_map(tmp_path / "macros.tex")
    ours = [k for k in m if re.fullmatch(r"pkvClaim[A-Za-z]+(Fair|Pub)(CI)?", k) or k.startswith("pkvClaim") and "Ratio" in k]
    assert ours and all(m[k] == tables.NM for k in ours), {k: m[k] for k in ours if m[k] != tables.NM}
    for key in ("pkvReadCeiling", "pkvCommit", "pkvDriver"):
        assert m[key] == tables.NM
    assert "not measured" in m["pkvClaimOneSentence"]
    assert m["pkvNumNotMeasured"] == str(len(claims.CLAIMS))
    assert "nvidia-h200" in (tmp_path / "tables" / "provenance.tex").read_text()


def render_report(root: Path, results, payload) -> str:
    figures.render_all(results, root / "figs", "svg")
    out = report.render(payload, results, root / "figs", root / "report.html")
    return out.read_text()


def test_report_is_self_contained(measured, tmp_path):
    _, results, payload = measured
    html = render_report(tmp_path, results, payload)
    assert "<script" not in html.lower()
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:|#)""", html), "a src/href leaves the page"
    assert "http://" not in html and "https://" not in html
    uris = re.findall(r'<img src="data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(uris) == len(FIGURE_NAMES)
    for data in uris:
        assert base64.b64decode(data).lstrip().startswith(b"<?xml")
    assert 'id="claims-table"' in html
    assert html.index('id="claims-table"') < html.index('id="figures"')      # claims at the top
    for c in payload["claims"]:
        assert f'<td class="id">{c["id"]}</td>' in html
    assert synthetic.GPU in html and "synthetic-run" in html             # provenance shown
    full = synthetic.provenance()[synthetic.RUN_ID]["config_hash"]
    assert f'<code title="{full}">{full[:tables.HASH_CHARS]}</code>' in html and f">{full}<" not in html
    assert "torch-sdpa" in html and "synthetic: torch-sdpa skipped" in html   # unavailable with reason
    engine = payload["engine"]
    assert 'id="engine"' in html and all(s.replace("'", "&#39;") in html for s in engine["sentences"])
    coverage = html[html.index('id="coverage"'):html.index('id="provenance"')]
    assert "<th>host CPU</th>" in coverage
    assert "pinned (2 CPUs, probe 150-152 us)" in coverage and "not recorded" in coverage  # bench / gqa_sweep


def test_host_cpu_text_says_pinned_unpinned_or_not_recorded():
    import numpy as np
    import pandas as pd

    rows = pd.DataFrame({"protocol": ["kernel", "eager", "eager", "ceiling"], "host_cpu": [3, 5, 5, -1],
                         "host_probe_us": [151.0, 160.4, 149.6, np.nan]})
    assert report.host_cpu_text(rows) == "pinned (2 CPUs, probe 150-160 us)"  # ceiling rows are not timing rows
    assert report.host_cpu_text(rows.assign(host_cpu=-1)) == "not pinned"
    assert report.host_cpu_text(rows.drop(columns=["host_cpu", "host_probe_us"])) == "not recorded"
    mixed = pd.concat([rows, pd.DataFrame({"protocol": ["step", "step"], "host_cpu": [np.nan, -1]})])
    assert report.host_cpu_text(mixed) == "pinned (3 of 4 rows, 2 CPUs, probe 150-160 us); 1 row not recorded"
    assert report.host_cpu_text(rows.iloc[:0]) == ""


def test_report_without_measurements_says_so(empty, tmp_path):
    _, results, payload = empty
    html = render_report(tmp_path, results, payload)
    assert "Nothing has been measured on <code>nvidia-h200</code> yet" in html
    assert html.count("not measured on nvidia-h200 yet") >= 7           # one per experiment row
    assert "Not measured: no bench_kernels kernel rows of pkv-workqueue." in html


def test_report_refuses_mismatched_or_missing_inputs(measured, empty, tmp_path):
    _, results, payload = measured
    _, other, _ = empty
    with pytest.raises(PKVError, match="claims are for hardware 'synthetic-gpu'"):
        report.render(payload, other, tmp_path, tmp_path / "r.html")
    with pytest.raises(PKVError, match="run 'persistentkv figures'"):
        report.render(payload, results, tmp_path / "nowhere", tmp_path / "r.html")


def test_commands_end_to_end(measured, tmp_path, monkeypatch, capsys):
    root, _, _ = measured
    work = tmp_path / "repo"
    shutil.copytree(REPO / "config", work / "config")
    shutil.copytree(root / "results", work / "results")
    monkeypatch.chdir(work)
    hw = "results/synthetic-gpu"
    assert cli.main(["claims", "--results", hw, "--out", f"{hw}/claims.json"]) == 0
    assert cli.main(["figures", "--results", hw, "--out-dir", "figs"]) == 0
    assert cli.main(["tables", "--results", hw, "--claims", f"{hw}/claims.json", "--out-dir", "gen"]) == 0
    assert cli.main(["report", "--results", hw, "--claims", f"{hw}/claims.json", "--figures-dir", "figs",
                     "--out", f"{hw}/report.html"]) == 0
    assert (work / hw / "report.html").stat().st_size > 10_000
    assert (work / "gen" / "macros.tex").is_file()
    floats = []    # claims.json publishes every float as io.PRECISION["claims"] says

    def collect(value):
        if isinstance(value, dict):
            [collect(v) for v in value.values()]
        elif isinstance(value, list):
            [collect(v) for v in value]
        elif isinstance(value, float):
            floats.append(value)

    collect(json.loads((work / hw / "claims.json").read_text()))
    assert len(floats) > 100
    assert floats == [io.significant(x, "claims") for x in floats]
    capsys.readouterr()
    assert cli.main(["tables", "--results", hw, "--claims", "missing.json", "--out-dir", "gen"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: claims file missing.json does not exist") and "\n" not in err
    (work / "bad.json").write_text("{not json")
    assert cli.main(["report", "--results", hw, "--claims", "bad.json", "--figures-dir", "figs", "--out", "x.html"]) == 2
    assert "bad.json is not valid JSON" in capsys.readouterr().err


def test_corrupt_results_file_is_a_one_line_error(tmp_path):
    hw_dir = tmp_path / "results" / "gpu-x"
    (hw_dir / "raw").mkdir(parents=True)
    (hw_dir / "raw" / "published.parquet").write_text("not parquet")
    with pytest.raises(PKVError, match="cannot read .*published.parquet"):
        load_results(hw_dir)


NEEDS_LATEX = pytest.mark.skipif(shutil.which("latexmk") is None or shutil.which("pdflatex") is None,
                                 reason="needs latexmk and pdflatex (apt-get install latexmk lmodern "
                                        "texlive-latex-recommended texlive-latex-extra texlive-fonts-recommended)")


def overfull(log: Path, tolerance_pt: float = 1.0) -> list[str]:
    """The boxes TeX reports wider than their line (text running into the margin or the next
    column) by more than ``tolerance_pt``."""
    text = log.read_text(errors="replace")
    return [m.group(0) for m in re.finditer(r"Overfull \\hbox \((\d+(?:\.\d+)?)pt too wide\)[^\n]*", text)
            if float(m.group(1)) > tolerance_pt]


@pytest.mark.slow
@NEEDS_LATEX
def test_paper_builds_without_undefined_references_byte_for_byte(measured, tmp_path):
    from persistentkv.render.paper import build_pdf

    _, results, payload = measured
    paper = tmp_path / "paper"
    paper.mkdir()
    shutil.copy(REPO / "paper" / "main.tex", paper)
    shutil.copy(REPO / "paper" / "refs.bib", paper)
    tables.render(payload, results, paper / "generated")
    figures.render_all(results, paper / "generated" / "figures", "pdf")
    pdf = build_pdf(paper / "main.tex", paper / "main.pdf", tmp_path / "build")
    assert pdf.read_bytes().startswith(b"%PDF")
    # Every macro the text uses is defined by macros.tex (an undefined one fails the build above).
    used = set(re.findall(r"\\(pkv[A-Za-z]+)", (paper / "main.tex").read_text()))
    assert used <= set(macro_map(paper / "generated" / "macros.tex"))
    # A rebuild from scratch a second later is the same file: no date, no trailer id.
    import time

    time.sleep(1.1)
    again = build_pdf(paper / "main.tex", tmp_path / "again.pdf", tmp_path / "build-again")
    assert again.read_bytes() == pdf.read_bytes()
    assert b"/CreationDate" not in pdf.read_bytes() and b"/ID [" not in pdf.read_bytes()
    assert overfull(tmp_path / "build" / "main.log") == []


@pytest.mark.slow
@NEEDS_LATEX
def test_committed_paper_fits_its_page(tmp_path):
    """The paper as the repository renders it (its generated/ from the H200 rows): no line or
    table cell runs past its box (the commit and config-hash lists once ran 188 pt off page 2)."""
    from persistentkv.render.paper import build_pdf

    paper = tmp_path / "paper"
    shutil.copytree(REPO / "paper" / "generated", paper / "generated")
    shutil.copy(REPO / "paper" / "main.tex", paper)
    shutil.copy(REPO / "paper" / "refs.bib", paper)
    build_pdf(paper / "main.tex", paper / "main.pdf", tmp_path / "build")
    assert overfull(tmp_path / "build" / "main.log") == []


@NEEDS_LATEX
def test_paper_build_error_is_the_tex_error(tmp_path):
    from persistentkv.render.paper import build_pdf

    (tmp_path / "bad.tex").write_text("\\documentclass{article}\\usepackage{nosuchpackage}\\begin{document}x\\end{document}\n")
    with pytest.raises(PKVError, match=r"bad.tex did not build: ! LaTeX Error: File `nosuchpackage.sty' not found"):
        build_pdf(tmp_path / "bad.tex", tmp_path / "bad.pdf", tmp_path / "build")


def test_paper_text_has_no_hand_typed_numbers():
    """Numbers reach the paper's prose only through macros: no digit outside commands, labels,
    citations, LaTeX setup and the workload labels (B=1, G=4 ...)."""
    text = (REPO / "paper" / "main.tex").read_text()
    body = text[text.index(r"\begin{document}"):]
    body = re.sub(r"%.*", "", body)
    body = re.sub(r"\\(label|ref|cite|input|gentable|genfigure|includegraphics|begin|end|bibliography\w*)"
                  r"(\[[^\]]*\])?\{[^}]*\}", "", body)
    body = re.sub(r"\b[BG]=\d+\b|\bL2\b|\bFlashAttention-3\b|\bfloat(16|32|64)\b|\\itemsep0pt|\(s\+1\)", "",
                  body)
    assert not re.findall(r"\d", body), re.findall(r".{20}\d.{20}", body)


def test_engine_figure_data_places_every_grid_case_and_its_target(measured):
    """data_engine_grid: one row per equal-length bench_kernels case (ragged ones left out), the
    ratio equal to the claims' mid-range verdict where there is one, the target only there;
    data_engine_host: per-case medians of host_loop_us for every backend with eager rows."""
    _, results, payload = measured
    grid = figures.data_engine_grid(results)
    traces = set(results.bench.loc[results.bench["protocol"] == "kernel", "trace"]) - {"ceiling"}
    assert sorted(f"B{b}xN{n}" for b, n in zip(grid["batch_size"], grid["tokens"])) == sorted(traces)
    mid = {m["trace"]: m for m in payload["engine"]["mid_range"] if m["measured"]}
    assert mid  # the synthetic grid holds mid-range cases, so the comparison below can fail
    for r in grid.itertuples():
        name = f"B{r.batch_size}xN{r.tokens}"
        if name in mid:
            assert r.ratio == pytest.approx(mid[name]["ratio"]) and r.target == mid[name]["target"]
        else:
            assert r.target != r.target  # NaN: no target outside the mid range
    host = figures.data_engine_host(results)
    eager = results.bench[results.bench["protocol"] == "eager"]
    assert set(host["backend"]) == set(eager["backend"]) and len(host) == eager.groupby(["backend", "trace"]).ngroups
    one = eager[(eager["backend"] == "pkv-workqueue") & (eager["trace"] == host["trace"].iloc[0])]
    row = host[(host["backend"] == "pkv-workqueue") & (host["trace"] == host["trace"].iloc[0])]
    assert row["host_loop_us"].iloc[0] == pytest.approx(one["host_loop_us"].median())


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs git and a checkout")
def test_gitignore_hides_no_tracked_file_but_a_killed_writers_leftovers():
    """.gitignore names no file the repository tracks (a tracked file it matched would vanish from
    `git status` once re-rendered), and it does name the temporary file a writer killed mid-write
    leaves beside a result (persistentkv.io), which `git status` would otherwise show."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)

    assert git("ls-files", "--cached", "--ignored", "--exclude-per-directory=.gitignore").stdout == ""
    for leftover in ("results/nvidia-h200/.claims.json.k3x9q1.tmp", "paper/generated/.macros.tex.a1b2c3.tmp"):
        assert git("check-ignore", "--no-index", "-q", leftover).returncode == 0, leftover
    for kept in ("results/nvidia-h200/claims.json", "paper/main.pdf", "results/nvidia-h200/report.html"):
        assert git("check-ignore", "--no-index", "-q", kept).returncode == 1, kept


def floor_section(html: str) -> str:
    start = html.index('<section id="floor">')
    return html[start:html.index("</section>", start)]


def test_report_shows_the_floor_column_and_the_shapes_section(measured, tmp_path):
    from persistentkv import targets

    _, results, payload = measured
    payload = {**payload, "floor": targets.floor_verdicts(results)}
    html = render_report(tmp_path, results, payload)
    section = floor_section(html)
    for s in payload["floor"]["sentences"]:
        assert s.replace("'", "&#39;") in section
    engine = section[section.index('id="floor-engine"'):section.index("</table>", section.index('id="floor-engine"'))]
    assert engine.count("<tr>") == 1 + sum(e["source"] == "bench_kernels" for e in payload["floor"]["floor"]["cases"])
    shapes = section[section.index('id="shapes"'):section.index("</table>", section.index('id="shapes"'))]
    assert shapes.count("<tr>") == 1 + 72                                   # the heading and every synthetic case
    assert '<a href="#fig-shapes">' in section  # the figure itself is drawn once, under Figures
    assert html.count('data-figure="shapes"') == 1 and 'alt="The shapes experiment"' in html
    assert '<a href="#fig-shapes_floor">' in section and html.count('data-figure="shapes_floor"') == 1
    assert 'id="shapes-invariance"' in section and "not measured on" not in section


def test_shapes_floor_figure_draws_each_shape_s_fraction_and_the_bands(measured):
    """fig_shapes_floor: per panel (batch size) one line per (Hkv, G) whose points are floor / ours
    of data_shapes' rows, and one black segment per FLOOR_BANDS target at its value."""
    from persistentkv import targets

    _, results, _ = measured
    frame = figures.data_shapes(results)
    fig = figures.fig_shapes_floor(frame, "nvidia-h200")
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == frame["batch_size"].nunique() == 3
    for ax, b in zip(axes, sorted(frame["batch_size"].unique())):
        assert ax.get_title() == f"B = {b}"
        panel = frame[frame["batch_size"] == b]
        lines = [ln for ln in ax.get_lines() if ln.get_label().startswith("Hkv=")]
        assert len(lines) == panel.groupby(["num_kv_heads", "group_size"]).ngroups == 6
        for ln in lines:
            h, g = (int(part.split("=")[1]) for part in ln.get_label().split(", "))
            rows = panel[(panel["num_kv_heads"] == h) & (panel["group_size"] == g)].sort_values("kv_bytes")
            np.testing.assert_allclose(ln.get_ydata(), rows["floor"] / rows["ours"])
            np.testing.assert_allclose(ln.get_xdata(), rows["kv_bytes"] / 1e6)
        bands = sorted(seg[0][1] for coll in ax.collections for seg in coll.get_segments())
        assert bands == sorted(t for _, _, t in targets.FLOOR_BANDS)
    empty = figures.fig_shapes_floor(frame.iloc[:0], "nvidia-h200")
    assert "not measured on nvidia-h200" in svg_text(empty)


def test_report_floor_section_without_rows_says_not_measured(empty, tmp_path):
    from persistentkv import targets

    _, results, payload = empty
    payload = {**payload, "floor": targets.floor_verdicts(results)}
    section = floor_section(render_report(tmp_path, results, payload))
    assert "not measured on nvidia-h200 yet (no bench_kernels kernel rows" in section
    assert "not measured on nvidia-h200 yet (no bench_shapes.parquet" in section
    assert 'id="shapes"' not in section and 'id="floor-engine"' not in section
