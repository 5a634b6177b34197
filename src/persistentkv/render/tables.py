"""LaTeX tables and macros (jinja2) for paper/generated/.

Numbers reach the paper's prose only through ``macros.tex``: one ``\\newcommand`` per number or
sentence, named ``\\pkv<Thing>`` (letters only, as TeX requires). A value not measured renders as
``\\pkvNM`` (a bold "n/m"), never as a made-up number. The claims come from claims.json (the
``claims`` command), so the paper, the report and the claims table say the same thing.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import jinja2

from .. import claims, targets, targets_fp8
from ..errors import PKVError, require
from ..io import atomic_write_text
from ..results import Results
from . import TABLE_NAMES

NM = r"\pkvNM{}"
TEMPLATES = Path(__file__).parent / "templates"
TABLES = TABLE_NAMES
_TEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
_TEX_UNICODE = {"×": r"$\times$", "→": r"$\to$", "±": r"$\pm$", "ρ": r"$\rho$", "‖": r"$\|$", "−": r"$-$",
                "≤": r"$\le$", "≥": r"$\ge$", "–": "--", "—": "---", "…": r"\ldots{}", "’": "'", "μ": r"$\mu$"}
_MACRO_NAME = re.compile(r"^pkv[A-Za-z]+$")


def tex(text) -> str:
    """Escape plain (unicode) text for LaTeX body text."""
    if text is None:
        return NM
    out = []
    for ch in str(text):
        if ch in _TEX_SPECIAL:
            out.append(_TEX_SPECIAL[ch])
        elif ch in _TEX_UNICODE:
            out.append(_TEX_UNICODE[ch])
        elif ord(ch) < 128:
            out.append(ch)
        else:
            raise PKVError(f"no LaTeX spelling for character {ch!r} in {str(text)[:60]!r}")
    # "n/m" from the claims module is the not-measured placeholder: make it the visible macro.
    return re.sub(r"\bn/m\b", lambda _: NM, "".join(out))


def finite(value) -> bool:
    return value is not None and isinstance(value, (int, float)) and math.isfinite(value)


def tex_ratio(value, digits: int = 3) -> str:
    return rf"{value:.{digits}f}$\times$" if finite(value) else NM


def tex_ci(lo, hi, digits: int = 3) -> str:
    return f"[{lo:.{digits}f}, {hi:.{digits}f}]" if finite(lo) and finite(hi) else NM


def tex_entry(entry: dict | None, digits: int = 3) -> str:
    """A {value, lo, hi} dict as 'v× [lo, hi]' (or n/m)."""
    if not entry or not finite(entry.get("value")):
        return NM
    return f"{tex_ratio(entry['value'], digits)} {{\\scriptsize {tex_ci(entry.get('lo'), entry.get('hi'), digits)}}}"


def tex_pm(value, sd, digits: int = 3) -> str:
    if not finite(value):
        return NM
    return f"{value:.{digits}f}" + (rf" $\pm$ {sd:.{digits}f}" if finite(sd) else "")


def environment() -> jinja2.Environment:
    """Jinja for LaTeX: ((* blocks *)), ((( variables ))), ((# comments #)); undefined is an error."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), block_start_string="((*",
                             block_end_string="*))", variable_start_string="(((", variable_end_string=")))",
                             comment_start_string="((#", comment_end_string="#))", trim_blocks=True,
                             lstrip_blocks=True, autoescape=False, undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    env.filters.update(tex=tex, ratio=tex_ratio, ci=tex_ci, entry=tex_entry, pm=tex_pm)
    env.globals["machine_value"] = machine_value
    return env


# ---------------------------------------------------------------------------------------------
# Macros

def _short_commits(results: Results) -> str | None:
    commits = sorted({str(p.get("git_commit"))[:10] + ("+dirty" if p.get("git_dirty") else "")
                      for p in results.provenance.values() if p.get("git_commit")})
    return ", ".join(commits) if commits else None


def _prov_field(results: Results, key: str) -> str | None:
    values = sorted({str(p.get(key)) for p in results.provenance.values() if p.get(key) not in (None, "")})
    return ", ".join(values) if values else None


def read_ceiling_gbps(results: Results) -> float | None:
    """Read ceiling measured on this hardware: the median over runs of each run's ceiling (the
    ``read_ceiling_gbps`` of its read-ceiling rows, the largest size's rate; a median of the
    samples' GB/s would mix the sizes), else of the samples' GB/s, else of the raw column."""
    import numpy as np
    import pandas as pd

    ceil = results.ceilings
    if not ceil.empty and "kv_bytes" in ceil and "per_layer_us" in ceil:
        rc = ceil[ceil["backend"] == "read-ceiling"]
        if "read_ceiling_gbps" in rc and "run_id" in rc:
            per_run = pd.to_numeric(rc["read_ceiling_gbps"], errors="coerce").groupby(rc["run_id"]).median()
            per_run = per_run[np.isfinite(per_run.to_numpy(float))]
            if per_run.size:
                return float(per_run.median())
        vals = (rc["kv_bytes"] / rc["per_layer_us"] / 1e3).to_numpy(float)
        vals = vals[np.isfinite(vals)]
        if vals.size:
            return float(np.median(vals))
    timing = results.timing
    if not timing.empty and "read_ceiling_gbps" in timing:
        vals = timing["read_ceiling_gbps"].to_numpy(float)
        vals = vals[np.isfinite(vals)]
        if vals.size:
            return float(np.median(vals))
    return None


def macros(payload: dict, results: Results) -> list[tuple[str, str, str]]:
    """(name, TeX value, comment) for every macro; names are unique and letters-only."""
    cfg = results.config or {}
    measure = cfg.get("measure", {})
    seeds = cfg.get("seeds", {})
    m: list[tuple[str, str, str]] = []

    def add(name: str, value: str, comment: str = "") -> None:
        m.append((name, value, comment))

    measured = results.measured_experiments()
    add("pkvHw", tex(results.hw), "hardware slug of results/<hw>/")
    add("pkvGPU", tex(payload["gpu"]) if results.provenance else tex(f"{results.hw} (not measured yet)"),
        "GPU named by provenance.json")
    add("pkvPaperGPU", tex(claims.PAPER_GPU), claims.SOURCE)
    add("pkvMeasuredExperiments", str(len(measured)), "experiments with timing rows")
    add("pkvMeasuredList", tex(", ".join(measured)) if measured else tex("none"), "")
    add("pkvNotMeasuredNote",
        "" if measured else tex(f"Nothing has been measured on {results.hw} yet: every figure of ours below "
                                "reads n/m and every verdict reads 'not measured'."),
        "empty once anything is measured")
    add("pkvCommit", tex(_short_commits(results)), "git commit(s) of the measuring runs")
    for key, name in (("driver", "Driver"), ("cuda", "Cuda"), ("torch", "Torch"),
                      ("cupy", "Cupy"), ("flashinfer", "FlashInfer"), ("vllm", "Vllm"), ("sm_count", "SMs")):
        add(f"pkv{name}", tex(_prov_field(results, key)), f"provenance field {key}")
    ceiling = read_ceiling_gbps(results)
    add("pkvReadCeiling", f"{ceiling:,.0f}".replace(",", "{,}") if ceiling else NM, "GB/s, measured read ceiling")
    spec = cfg.get("spec", {})
    for key, name in (("num_qo_heads", "NumQoHeads"), ("num_kv_heads", "NumKvHeads"), ("head_dim", "HeadDim"),
                      ("page_size", "PageSize"), ("dtype", "Dtype")):
        add(f"pkv{name}", tex(spec.get(key)), f"config spec.{key}")
    if spec.get("num_qo_heads") and spec.get("num_kv_heads"):
        add("pkvGroupSize", str(spec["num_qo_heads"] // spec["num_kv_heads"]), "G = Hq / Hkv")
    else:
        add("pkvGroupSize", NM, "G = Hq / Hkv")
    add("pkvTargetItems", tex(cfg.get("planner", {}).get("target_items")), "config planner.target_items")
    for key, name in (("gpu", "GPUFull"), ("sms", "SMs"), ("arch", "Arch"), ("bandwidth_gbps", "Bandwidth"),
                      ("theoretical_gbps", "TheoreticalBandwidth"), ("cuda", "Cuda"), ("torch", "Torch"),
                      ("flashinfer", "FlashInfer"), ("vllm", "Vllm"), ("trtllm", "Trtllm")):
        add(f"pkvPaper{name}", tex(claims.PAPER_SETUP[key]), "docs/PAPER.md, Evaluation protocol (as published)")
    add("pkvCalibrationSeed", tex(seeds.get("calibration")), "config seeds.calibration")
    holdout = seeds.get("holdout") or []
    add("pkvHoldoutSeeds", tex(", ".join(map(str, holdout))) if holdout else NM, "config seeds.holdout")
    add("pkvNumHoldoutSeeds", str(len(holdout)) if holdout else NM, "")
    for key, name in (("layers", "Layers"), ("repeats", "Repeats"), ("warmup", "Warmup"),
                      ("step_stride", "StepStride")):
        add(f"pkv{name}", tex(measure.get(key)), f"config measure.{key}")
    add("pkvStepRepeats", tex(measure.get("step_repeats", measure.get("repeats"))),
        "config measure.step_repeats (else measure.repeats)")
    add("pkvBenchRepeats", tex(measure.get("bench_repeats", measure.get("repeats"))),
        "config measure.bench_repeats (else measure.repeats)")
    add("pkvNBoot", str(payload["n_boot"]), "bootstrap replicates")
    add("pkvConfidence", f"{payload['confidence'] * 100:g}", "interval coverage, percent")
    add("pkvBootSeed", str(payload["boot_seed"]), "bootstrap generator seed")
    add("pkvMargin", f"{payload['margin'] * 100:g}", "claims.MARGIN, percent: the smallest difference between designs")
    counts = payload["counts"]
    add("pkvNumClaims", str(len(payload["claims"])), "")
    for verdict, name in ((claims.HOLDS, "Hold"), (claims.ONLY_PUBLISHED, "OnlyPublished"),
                          (claims.FAILS, "Fail"), (claims.NOT_MEASURED, "NotMeasured")):
        add(f"pkvNum{name}", str(counts.get(verdict, 0)), f"claims whose verdict is '{verdict}'")

    for c in payload["claims"]:
        w = f"pkvClaim{c['word']}"
        fair, pub = c["fair"], c["published"]
        add(f"{w}Title", tex(c["title"]), c["id"])
        add(f"{w}Paper", tex(c["paper"]), claims.SOURCE)
        for side, label in ((fair, "Fair"), (pub, "Pub")):
            if fair.get("unit") == "ratio" and finite(side.get("value")):
                add(f"{w}{label}", tex_ratio(side["value"]), f"{c['id']} ours, {side['protocol']} protocol")
                add(f"{w}{label}CI", tex_ci(side.get("lo"), side.get("hi")), "95% bootstrap interval")
            elif side.get("check") is not None:
                add(f"{w}{label}", tex(side["display"]), f"{c['id']} ours, {side['protocol']} protocol")
                add(f"{w}{label}CI", tex("(exact counters)") if side.get("unit") in ("factor", "fraction")
                    else tex_ci(side.get("lo"), side.get("hi")), "")
            else:
                add(f"{w}{label}", NM, f"{c['id']} not measured ({side['protocol']})")
                add(f"{w}{label}CI", NM, "")
        if fair.get("unit") == "ratio":
            add(f"{w}RatioFair", tex_ratio(fair.get("value")), "alias")
            add(f"{w}RatioPub", tex_ratio(pub.get("value")), "alias")
        add(f"{w}Verdict", tex(c["verdict"]), "")
        add(f"{w}Sentence", tex(c["sentence"]), "generated from the verdict")
    adaptive = payload.get("adaptive", {}).get("protocols", {})
    for protocol, word in (("step", "Step"), ("kernel", "Kernel")):
        entry = adaptive.get(protocol)
        if not entry or not entry.get("cells"):
            add(f"pkvAdaptive{word}Sentence", NM, f"adaptive on holdout, {protocol} rows: not measured")
            continue
        add(f"pkvAdaptive{word}Sentence", tex(entry["sentence"]), "claims.adaptive_verdicts")
    m.extend(e2e_macros(payload))
    m.extend(floor_macros(payload))
    m.extend(fp8_macros(payload))
    names = [n for n, _, _ in m]
    bad = [n for n in names if not _MACRO_NAME.match(n)]
    require(not bad, f"macro name {bad[0] if bad else ''!r} is not letters-only")
    dup = sorted({n for n in names if names.count(n) > 1})
    require(not dup, f"macro {dup[0] if dup else ''!r} defined twice")
    return m


def floor_macros(payload: dict) -> list[tuple[str, str, str]]:
    """The one-kernel floor's and the shapes experiment's verdicts (claims.json ``floor``,
    targets.floor_verdicts) as one sentence macro; not measured without rows."""
    sentences = (payload.get("floor") or {}).get("sentences") or [
        f"Not measured: no one-kernel floor rows (bench_kernels, bench_shapes) on {payload['hw']} yet."]
    return [("pkvFloorSentences", tex(" ".join(sentences)), "targets.floor_verdicts")]


def e2e_macros(payload: dict) -> list[tuple[str, str, str]]:
    """The full decode step's macros (claims.json ``e2e``, targets.e2e_verdicts): its rules' minimum
    ratios, the two verdicts, the lowest cell and the sentences; not measured (n/m) without rows.
    The macro names and their comments in macros.tex keep the constants' earlier names
    (pkvEtoeStepFloor, targets.E2E_STEP_FLOOR): the generated files stay as they were."""
    e = payload.get("e2e") or {}
    step, gain = e.get("step") or {}, e.get("gain") or {}
    low = step.get("min") or {}
    verdict = lambda part: tex("holds" if part["holds"] else "does not hold") if part else tex(claims.NOT_MEASURED)
    sentences = e.get("sentences") or [f"Not measured: no full decode step rows (e2e/pass*.parquet) on {payload['hw']} yet."]
    return [
        ("pkvEtoeStepFloor", f"{targets.E2E_STEP_MIN_RATIO:g}", "targets.E2E_STEP_FLOOR"),
        ("pkvEtoeRestFloor", f"{targets.E2E_REST_MIN_FRACTION:g}", "targets.E2E_REST_FLOOR"),
        ("pkvEtoeTail", f"{100 * targets.E2E_TAIL:g}", "targets.E2E_TAIL, percent"),
        ("pkvEtoeCells", str(step["cells"]) if step else NM, "cells with ours and a baseline"),
        ("pkvEtoeStepVerdict", verdict(step), "every cell's step at least pkvEtoeStepFloor of the fastest baseline's"),
        ("pkvEtoeGainVerdict", verdict(gain), "the measured speedup reaches its Amdahl prediction in every cell"),
        ("pkvEtoeGainReached", str(gain["reached"]) if gain else NM, "cells where it does"),
        ("pkvEtoeMinCell", tex(low.get("label")) if low else NM, "the cell of the lowest step ratio"),
        ("pkvEtoeMinRatio", tex_ratio(low.get("ratio")) if low else NM, "its ratio"),
        ("pkvEtoeMinCI", tex_ci(low.get("lo"), low.get("hi")) if low else NM, "its 95% interval"),
        ("pkvEtoePartial", tex("The run stopped before its end: these are the configurations it finished. ")
         if e.get("complete") is False else "", "empty for a complete run"),
        ("pkvEtoeSentences", tex(" ".join(sentences)), "targets.e2e_verdicts"),
    ]


def fp8_macros(payload: dict) -> list[tuple[str, str, str]]:
    """The FP8 cache's rules and verdict (claims.json ``fp8``, targets_fp8.fp8_verdicts): the rules
    in words, the summary and the sentences; without the entry, its rules from targets_fp8 and
    "not measured"."""
    e = payload.get("fp8") or {}
    rules = e.get("rules") or targets_fp8.fp8_rules()
    summary = e.get("summary") or f"{targets.NOT_MEASURED} on {payload['hw']}"
    sentences = e.get("sentences") or [f"The FP8 grid: not measured on {payload['hw']}."]
    return [("pkvFpEightFormat", tex(f"FP8 ({targets_fp8.FP8_KV})"), "names.FP8_KV"),
            ("pkvFpEightRules", tex("; ".join(rules)), "targets_fp8.fp8_rules"),
            ("pkvFpEightSummary", tex(summary), "targets_fp8.fp8_verdicts"),
            ("pkvFpEightSentences", tex(" ".join(sentences)), "targets_fp8.fp8_verdicts")]


def fp8_absent() -> dict:
    """What the FP8 table reads from a claims payload without an ``fp8`` entry: not measured."""
    return {"measured": False, "command": targets_fp8.FP8_COMMAND}


def e2e_rows(payload: dict) -> list[dict]:
    """The full decode step's cells (claims.json ``e2e.cells``) for the paper's table."""
    return list((payload.get("e2e") or {}).get("cells") or [])


# ---------------------------------------------------------------------------------------------
# Tables

def ablation_rows(results: Results) -> list[dict]:
    """Per trace: median launches per variant and mean merge MB (paper count) per variant."""
    frame = results.ablation_buckets
    if frame.empty or not {"trace", "variant", "launches"} <= set(frame.columns):
        return []
    out = []
    order = [r.trace for r in claims.PUBLISHED_ROWS]
    for trace in sorted(frame["trace"].unique(), key=lambda t: (order.index(t) if t in order else 99, t)):
        part = frame[frame["trace"] == trace]
        launches = part.groupby("variant")["launches"].median().to_dict()
        merge = (part.groupby("variant")["paper_merge_state_bytes"].mean() / 1e6).to_dict() \
            if "paper_merge_state_bytes" in part else {}
        padded = (part.groupby("variant")["padded_kv_bytes"].mean() / 1e6).to_dict() if "padded_kv_bytes" in part else {}
        out.append({"trace": trace, "steps": int(part["step"].nunique()), "launches": launches, "merge": merge,
                    "padded": padded})
    return out


def variants(rows: list[dict]) -> list[str]:
    names = sorted({v for r in rows for v in r["launches"]})
    key = lambda v: (v != "exact", not v.startswith("padded"), v != "split_rect",
                     int(v.split("_")[-1]) if v.split("_")[-1].isdigit() else 0, v)
    return sorted(names, key=key)


#: The machine and software of a run (provenance.json), with the heading the tables give each.
MACHINE_FIELDS = {"gpu": "GPU", "sm_count": "SMs", "driver": "driver", "cuda": "CUDA", "torch": "torch",
                  "cupy": "CuPy", "flashinfer": "FlashInfer", "vllm": "vLLM"}
#: Characters of a config hash (sha256, 64 hex) that the tables print: enough to tell the runs'
#: configurations apart; provenance.json holds the whole hash.
HASH_CHARS = 12


def provenance_rows(results: Results) -> list[dict]:
    fields = (*MACHINE_FIELDS, "git_commit", "git_dirty", "git_source", "git_note", "config_hash", "started_at")
    return [{"run_id": run_id, **{f: p.get(f) for f in fields}} for run_id, p in sorted(results.provenance.items())]


def commit_counts(rows: list[dict]) -> list[tuple[str, int]]:
    """(commit, runs) over provenance_rows' ``rows``, the commit cut to 10 characters (+dirty where
    the tree was), most runs first: one pair when every run comes from one build."""
    from collections import Counter

    counts = Counter(str(r.get("git_commit") or "?")[:10] + ("+dirty" if r.get("git_dirty") else "") for r in rows)
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def machine_columns(rows: list[dict]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Split MACHINE_FIELDS into those every run shares and those that differ between runs.

    Returns (shared, varying): shared as (heading, value) pairs, said once beside a provenance
    table; varying as (field, heading) pairs, the table's columns. The GPU and its SM count are
    one field ("NVIDIA H200, 132 SMs"), so a table of runs on one GPU needs neither column."""
    shared, varying = [], []
    for field, heading in MACHINE_FIELDS.items():
        if field == "sm_count":
            continue
        values = {machine_value(r, field) for r in rows}
        if len(values) == 1:
            value = values.pop()
            if value:
                shared.append((heading, value))
        else:
            varying.append((field, heading))
    return shared, varying


def machine_value(row: dict, field: str) -> str:
    """A run's value of a MACHINE_FIELDS field as the tables print it ('' when not recorded)."""
    value = "" if row.get(field) in (None, "") else str(row[field])
    if field == "gpu" and row.get("sm_count") not in (None, ""):
        value += f" ({row['sm_count']} SMs)"
    return value


def render(payload: dict, results: Results, out_dir: str | Path) -> list[Path]:
    """Write macros.tex and tables/{claims,published_rows,ablation,provenance}.tex under ``out_dir``."""
    require(payload.get("format") == claims.FORMAT,
            f"claims payload has format {payload.get('format')!r}, expected {claims.FORMAT!r}")
    out_dir = Path(out_dir)
    env = environment()
    context = {"payload": payload, "hw": results.hw, "gpu": payload["gpu"], "paper_gpu": claims.PAPER_GPU,
               "claims": payload["claims"], "macros": macros(payload, results),
               "rows": claims.published_rows(results), "ablation": ablation_rows(results),
               "provenance": provenance_rows(results), "NM": NM, "source": claims.SOURCE, "hash_chars": HASH_CHARS}
    context["e2e"], context["e2e_cells"] = payload.get("e2e") or {}, e2e_rows(payload)
    context["fp8"] = payload.get("fp8") or fp8_absent()
    context["tail"] = f"{100 * targets.E2E_TAIL:g}"
    context["variants"] = variants(context["ablation"])
    context["shared"], context["varying"] = machine_columns(context["provenance"])
    written = []
    for name in ("macros",) + tuple(f"tables/{t}" for t in TABLES):
        text = env.get_template(f"{Path(name).name}.tex.j2").render(**context)
        path = out_dir / f"{name}.tex"
        atomic_write_text(path, text)
        written.append(path)
    return written
