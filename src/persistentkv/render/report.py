"""results/{hw}/report.html: one self-contained page (inline CSS, figures as base64 SVG data URIs,
no script, no external URL) that opens offline.

Order: the claims table, the paper's rows beside ours, the figures, validation per backend,
unavailable backends with their reasons, what is not measured yet, and provenance (which run,
GPU and commit each number came from). Every section starts with one "how to read this" line.
"""

from __future__ import annotations

import base64
import math
import re
from pathlib import Path

import jinja2
import pandas as pd
from markupsafe import Markup

from .. import analysis, claims, reproduce, targets
from ..analysis import pinning
from ..errors import PKVError, require
from ..io import PRECISION, atomic_write_text
from ..names import EXPERIMENTS
from ..results import Results
from . import figures
from .tables import (HASH_CHARS, ablation_rows, commit_counts, machine_columns, machine_value, provenance_rows,
                     read_ceiling_gbps, variants)

TEMPLATES = Path(__file__).parent / "templates"
VERDICT_CLASS = {claims.HOLDS: "holds", claims.ONLY_PUBLISHED: "only-published", claims.FAILS: "fails",
                 claims.NOT_MEASURED: "not-measured"}
MISSING_TEXT = {
    "raw/published": "published traces (claims C1-C5, C11)", "raw/long_context": "long-context B=1 sweep",
    "raw/fragmented": "fragmented pages (C10)", "raw/batch_sweep": "batch-size sweep",
    "raw/gqa_sweep": "GQA sweep (C8)", "raw/split_sensitivity": "split sensitivity",
    "raw/calibration": "calibration timings", "bench_kernels": "isolated kernels and read ceiling (C9)",
    "validation_gpu": "GPU validation against float64", "provenance": "provenance",
    "policy": "frozen policy (policy.json)", "kernels": "kernel resource usage (kernels.json)",
    "validation_cpu": "CPU validation (counters)", "ablation_buckets": "bucket ablation counters (C6, C7)",
    "ablation_splits": "split ablation counters",
    "e2e": "full Llama decode step per backend (e2e/pass*.parquet)",
}
MISSING_TEXT["bench_shapes"] = "the shapes experiment (Hkv x G x B x bytes) and its one-kernel floor"
#: Validation errors are published at these digits (io.PRECISION) and printed at them.
ERROR_DIGITS = PRECISION["error"][0]
_EXTERNAL = re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?!data:|#)[a-z][a-z0-9+.-]*:""", re.I)


def fmt_entry(entry: dict | None, digits: int = 3) -> str:
    if not entry or entry.get("value") is None or not math.isfinite(entry["value"]):
        return "n/m"
    return analysis.fmt_ratio(entry["value"], entry.get("lo"), entry.get("hi"), digits)


def fmt_entry_html(entry: dict | None, digits: int = 3) -> Markup:
    """``fmt_entry`` for a table cell: the ratio and its interval each kept whole, so a narrow
    column puts the interval under the ratio instead of widening the table."""
    return unbroken_parts(*fmt_entry(entry, digits).split(" ", 1))


def unbroken_parts(*parts: str) -> Markup:
    """Text parts joined by spaces where a line may break, each part kept on one line."""
    return Markup(" ").join(Markup('<span class="nb">{}</span>').format(p) for p in parts)


def fmt_pm(value, sd, digits: int = 3) -> str:
    return f"{value:.{digits}f}" + (f" ± {sd:.{digits}f}" if sd is not None else "")


def svg_data_uri(path: Path) -> str:
    data = path.read_bytes()
    require(data.lstrip().startswith((b"<?xml", b"<svg")), f"{path} is not an SVG file")
    return "data:image/svg+xml;base64," + base64.b64encode(data).decode("ascii")


def validation_rows(results: Results) -> list[dict]:
    """Per backend and cache dtype: checks, passed, the worst (row, head) relative error (marked
    "(whole batch)" where rows predating that column give only the whole-batch norm), that
    dtype's tolerance, status and reasons."""
    frame = figures.data_validation(results)
    if frame.empty:
        return []
    out = []
    for backend in figures._order(frame["backend"]):
        mine = frame[frame["backend"] == backend]
        for dtype in figures.dtype_order(mine["dtype"]):
            part = mine[mine["dtype"] == dtype]
            ok = part[part["status"] == "ok"]
            err = pd.to_numeric(ok["err"], errors="coerce")
            whole = " (whole batch)" if ok["whole_batch"].astype(bool).any() else ""
            reasons = sorted({reader_text(r) for r in part["reason"].dropna() if str(r)})
            n_pass = int(ok["passed"].astype(bool).sum())
            status = ("unavailable" if ok.empty and (part["status"] == "unavailable").any() else
                      "failed" if (ok.empty or n_pass < len(ok) or (part["status"] == "failed").any()) else "passed")
            out.append({"backend": backend, "dtype": dtype or "—", "source": part["source"].iloc[0],
                        "checks": int(len(ok)), "passed": n_pass,
                        "worst": f"{err.max():.{ERROR_DIGITS - 1}e}{whole}" if err.notna().any() else "—",
                        "rtol": f"{pd.to_numeric(ok['rtol'], errors='coerce').max():.1e}" if not ok.empty else "—",
                        "status": status, "reasons": "; ".join(reasons)})
    return out


#: An exception's class name at the start of a recorded reason ("PKVError: ..."): the harness
#: records why a backend could not run as the error said it; the reader needs the message only.
_EXCEPTION_PREFIX = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Warning):\s*")


def reader_text(reason) -> str:
    """A recorded reason as a sentence for the report: without the exception's class name."""
    return _EXCEPTION_PREFIX.sub("", str(reason)).strip()


def unavailable_rows(results: Results) -> list[dict]:
    """Backends that could not run, grouped by (backend, status, reason), with the experiments."""
    timing = results.timing
    if timing.empty or "status" not in timing:
        return []
    bad = timing[timing["status"] != "ok"]
    if bad.empty:
        return []
    bad = bad.assign(reason=bad.get("reason", pd.Series("", index=bad.index)).fillna(""))
    out = []
    for (backend, status, reason), part in bad.groupby(["backend", "status", "reason"], sort=True):
        out.append({"backend": backend, "status": status, "reason": reader_text(reason) or "(no reason recorded)",
                    "experiments": ", ".join(sorted(part["experiment"].astype(str).unique()))})
    return out


def experiment_rows(results: Results) -> list[dict]:
    """Per experiment: measured or not, rows, backends ok, runs (run_id -> GPU, commit)."""
    timing = results.timing
    out = []
    names = list(EXPERIMENTS) + ["bench_kernels"]
    if not timing.empty:
        names += sorted(set(timing["experiment"]) - set(names))
    for exp in names:
        part = timing[timing["experiment"] == exp] if not timing.empty else timing
        ok = part[part["status"] == "ok"] if not part.empty else part
        runs = sorted(part["run_id"].dropna().astype(str).unique()) if "run_id" in part else []
        prov = [f"{r}: {results.provenance.get(r, {}).get('gpu', '?')}, commit "
                f"{str(results.provenance.get(r, {}).get('git_commit', '?'))[:10]}" for r in runs]
        out.append({"experiment": exp, "measured": not ok.empty, "rows": int(len(ok)),
                    "backends": ", ".join(figures._order(ok["backend"].unique())) if not ok.empty else "",
                    "protocols": ", ".join(sorted(ok["protocol"].unique())) if not ok.empty else "",
                    "host_cpu": host_cpu_text(ok), "runs": "; ".join(prov)})
    return out


def host_cpu_text(rows: pd.DataFrame) -> str:
    """Where the timing thread ran for these (ok) rows: pinned (how many CPUs, the probe's range),
    not pinned, or not recorded (runs before the host_cpu column); '' without timing rows."""
    timed = rows[rows["protocol"] != "ceiling"] if "protocol" in rows else rows
    if timed.empty:
        return ""
    p = pinning(timed)
    if not p["recorded"]:
        return "not recorded"
    if not p["pinned"]:
        return "not pinned"
    share = "" if p["pinned"] == p["recorded"] else f"{p['pinned']} of {p['recorded']} rows, "
    where = f", probe {p['probe_us'][0]:.0f}-{p['probe_us'][1]:.0f} us" if p["probe_us"] else ""
    n = p["unrecorded"]
    rest = f"; {n} row{'s' if n != 1 else ''} not recorded" if n else ""
    return f"pinned ({share}{p['cpus']} CPUs{where}){rest}"


def kernel_rows(kernels) -> list[dict]:
    if not kernels:
        return []
    items = kernels.items() if isinstance(kernels, dict) else enumerate(kernels)
    out = []
    for name, info in items:
        if isinstance(info, dict) and "registers" in info:
            out.append({"name": str(name), **{k: info.get(k) for k in ("arch", "registers", "shared_bytes",
                                                                         "stack_bytes", "spill_store_bytes",
                                                                         "spill_load_bytes")}})
        elif isinstance(info, dict):   # nested {kernel: {arch: {...}}}
            for arch, sub in info.items():
                if isinstance(sub, dict):
                    out.append({"name": f"{name}", "arch": sub.get("arch", arch),
                                **{k: sub.get(k) for k in ("registers", "shared_bytes", "stack_bytes",
                                                           "spill_store_bytes", "spill_load_bytes")}})
    return out


def e2e_notes(results: Results) -> list[tuple[str, str]]:
    """(model, the config's note on its shape) for every model with e2e rows whose entry has one."""
    models = (results.config or {}).get("models") or {}
    measured = sorted(set(results.e2e["model"].dropna()) - {""}) if "model" in results.e2e else []
    return [(m, str(models[m]["note"]).rstrip(".")) for m in measured if (models.get(m) or {}).get("note")]


def ratio_ci(value, lo=None, hi=None) -> Markup:
    """A ratio and its interval for a table cell, each part kept whole (:func:`fmt_entry_html`)."""
    return unbroken_parts(*analysis.fmt_ratio(value, lo, hi).split(" ", 1))


def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(entry=fmt_entry, entry_html=fmt_entry_html,
                       verdict_class=lambda v: VERDICT_CLASS.get(v, "not-measured"))
    env.globals["machine_value"] = machine_value
    env.globals["ratio_ci"] = ratio_ci
    return env


def render(payload: dict, results: Results, figures_dir: str | Path, out: str | Path,
           reproduction: dict | None = None) -> Path:
    """Write the report for ``results`` (claims from ``payload``, SVGs from ``figures_dir``; the
    reproduction section from ``reproduction``, a reproduction.json payload, when given)."""
    require(payload.get("format") == claims.FORMAT,
            f"claims payload has format {payload.get('format')!r}, expected {claims.FORMAT!r}")
    require(payload.get("hw") == results.hw,
            f"claims are for hardware {payload.get('hw')!r} but the results folder is {results.hw!r}")
    figures_dir = Path(figures_dir)
    figs = []
    for spec in figures.FIGURES:
        path = figures_dir / f"{spec.name}.svg"
        if not path.is_file():
            raise PKVError(f"figure {path} is missing; run 'persistentkv figures' for {results.hw} first")
        figs.append({"name": spec.name, "title": spec.title, "how": spec.how_to_read, "uri": svg_data_uri(path)})
    # the full decode step's figure and the FP8 one stand in their own sections
    e2e_figure = next(f for f in figs if f["name"] == "e2e")
    fp8_figure = next(f for f in figs if f["name"] == "fp8")
    figs = [f for f in figs if f["name"] not in ("e2e", "fp8")]
    rows = claims.published_rows(results)
    for r in rows:
        r["paper_event_text"] = unbroken_parts(*fmt_pm(r["paper_event"], r["paper_event_sd"]).split(" ", 1))
        r["paper_wall_text"] = unbroken_parts(*fmt_pm(r["paper_wall"], r["paper_wall_sd"]).split(" ", 1))
    ablation = ablation_rows(results)
    ceiling = read_ceiling_gbps(results)
    missing = [MISSING_TEXT.get(m, m) for m in results.missing]
    provenance = provenance_rows(results)
    shared, varying = machine_columns(provenance)
    commits = commit_counts(provenance)
    context = {
        "hw": results.hw, "gpu": payload["gpu"], "payload": payload, "claims": payload["claims"],
        "counts": payload["counts"], "rows": rows, "figures": figs, "validation": validation_rows(results),
        "unavailable": unavailable_rows(results), "experiments": experiment_rows(results),
        "missing": missing, "provenance": provenance, "shared": shared, "varying": varying, "commits": commits,
        "hash_chars": HASH_CHARS,
        "ablation": ablation,
        "variants": variants(ablation), "kernels": kernel_rows(results.kernels), "policy": results.policy,
        "ceiling": f"{ceiling:,.0f} GB/s" if ceiling else None, "paper_gpu": claims.PAPER_GPU,
        "source": claims.SOURCE, "verdicts": claims.VERDICTS, "measured_any": bool(results.measured_experiments()),
        "n_boot": analysis.N_BOOT, "boot_seed": analysis.BOOT_SEED, "adaptive": payload.get("adaptive"),
        "engine": payload.get("engine"),
        "e2e": payload.get("e2e") or {}, "e2e_figure": e2e_figure, "e2e_notes": e2e_notes(results),
        "e2e_tail": f"{100 * targets.E2E_TAIL:g}",
    }
    context["reproduction"] = reproduction_context(reproduction)
    context.update(floor_context(payload.get("floor"), results))
    context.update(fp8_context(payload.get("fp8"), results, fp8_figure["uri"]))
    html = environment().get_template("report.html.j2").render(**context)
    external = _EXTERNAL.search(html)
    require(external is None, f"report would load an external resource: {external.group(0) if external else ''}")
    out = Path(out)
    atomic_write_text(out, html)
    return out


def floor_context(floor: dict | None, results: Results) -> dict:
    """The report's one-kernel floor and shapes sections from claims.json's ``floor`` entry
    (targets.floor_verdicts): ``floor``, the entry itself; ``floor_engine``, its bench_kernels cases
    (the engine section's floor column); ``shapes_rows``, one row per bench_shapes case with our time,
    the floor's, their fraction, and the speedup over the fastest baseline; ``shapes_measured``."""
    if not floor:
        return {"floor": None, "floor_engine": [], "shapes_rows": [], "shapes_measured": False}
    cases = floor.get("floor", {}).get("cases", [])
    speedups = {e["case"]: e for e in floor.get("baselines", {}).get("cases", [])}
    rows = []
    for e in cases:
        if e["source"] != "bench_shapes":
            continue
        s = speedups.get(e["case"])
        rows.append({**e, "speedup": s["ratio"] if s else None, "speedup_lo": s["lo"] if s else None,
                     "speedup_hi": s["hi"] if s else None, "baseline": s["baseline"] if s else "—"})
    return {"floor": floor, "floor_engine": [e for e in cases if e["source"] == "bench_kernels"],
            "shapes_rows": rows, "shapes_measured": not results.shapes.empty}


def fp8_context(entry: dict | None, results: Results, figure_uri: str) -> dict:
    """The report's FP8 section (templates/fp8.html.j2) from claims.json's ``fp8`` entry
    (targets_fp8.fp8_verdicts): ``fp8``, the entry; ``fp8_figure``, ``figure_uri`` (the fp8
    figure's SVG data URI: its placeholder says what to run where the FP8 grid has no rows);
    ``fp8_unavailable``, the FP8 grids' backends that did not run, with their reasons (they are
    not in :attr:`Results.timing`)."""
    unavailable = []
    for stem, grid in sorted(results.kv_grids.items()):
        bad = grid[grid["status"] != "ok"] if "status" in grid else grid.iloc[:0]
        for (backend, reason), _ in bad.groupby(["backend", bad["reason"].fillna("")], sort=True):
            unavailable.append({"file": stem, "backend": backend,
                                "reason": reader_text(reason) or "(no reason recorded)"})
    return {"fp8": entry, "fp8_figure": figure_uri, "fp8_unavailable": unavailable}


def read_reproduction(folder: str | Path) -> dict | None:
    """``folder``/reproduction.json (persistentkv reproduce-check), None where there is none."""
    path = Path(folder) / "reproduction.json"
    if not path.is_file():
        return None
    payload = reproduce.read_json(path)
    require(isinstance(payload, dict) and payload.get("format") == reproduce.FORMAT,
            f"{path} is not a {reproduce.FORMAT} file")
    return payload


def reproduction_context(payload: dict | None) -> dict | None:
    """The reproduction section's table from a reproduction.json payload (docs/DATA.md): one row per
    item with both sides as reproduce-check prints them; None without a payload."""
    if not payload:
        return None
    rows = [{"item": r["item"], "committed": reproduce.side_text(r["committed"], r["quantity"]),
             "measured": reproduce.side_text(r["measured"], r["quantity"]), "agrees": reproduce.agrees_text(r),
             "badge": "not-measured" if not r["judged"] else "holds" if r["agrees"] else "fails", "note": r["note"]}
            for r in payload["items"]]
    tolerances = payload.get("tolerances", {})
    return {**{k: payload[k] for k in ("reference", "measured", "same_gpu", "agrees", "counts")}, "rows": rows,
            **{k: f"{100 * tolerances[k]:g} %" for k in ("ratio_rtol", "time_rtol") if k in tolerances}}
