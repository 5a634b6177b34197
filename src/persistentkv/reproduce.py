"""Does a re-measured results folder reproduce the committed reference?

Two folders laid out as results/<hw>/ (docs/DATA.md): the reference (results/nvidia-h200/) and a
re-measured one (results/<gpu>/, or a results/ tree copied from another machine). Each folder's
hardware-independent results are read from its sibling ``counters/``. Compared, item by item:

* every claim of claims.json: the fair protocol's figure (``value``) and the verdict;
* every target judged beside the claims (claims.json's ``engine``, ``floor``, ``e2e`` and
  ``adaptive``): its figure (a ratio or fraction; the host loop's median in us) and whether it holds;
* every ``counters/*.parquet`` (planner counters, ablations, the CPU validation): the tables must
  be equal cell for cell, whatever hardware made them.

An item agrees when both verdicts are the same and the re-measured figure lies within the
tolerance of the committed one, relative to it: ``ratio_rtol`` for speedups, ratios and fractions,
``time_rtol`` for timing medians (config ``reproduce``, read before any result). When the GPUs
differ (provenance.json's ``gpu``), items that depend on the hardware are reported beside the
reference, not judged: "different GPU: reported, not judged". The claims judged on counters alone
(C6, C7) and the counters files are judged on any hardware.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .errors import PKVError, require

FORMAT = "persistentkv-reproduction/1"
#: A figure's quantity -> the config key of its relative tolerance.
TOLERANCE_KEYS = {"ratio": "ratio_rtol", "time": "time_rtol"}
HOLDS, FAILS, NOT_MEASURED = "holds", "does not hold", "not measured"
DIFFERENT_GPU = "different GPU: reported, not judged"
#: reproduce.measured's value for results/<the GPU this run measures> (hardware.target).
MEASURED_AUTO = "auto"
#: The floor checks of claims.json's ``floor`` (targets.floor_verdicts) and each one's per-case figure.
FLOOR_CHECKS = {"floor": ("cases", "frac"), "invariance": ("pairs", "ratio"), "baselines": ("cases", "ratio"),
                "small_heads": ("cases", "ratio")}


@dataclass(frozen=True)
class Tolerances:
    """Relative tolerances of a reproduction (config ``reproduce``)."""

    ratio: float
    time: float

    @classmethod
    def from_config(cls, config: dict) -> "Tolerances":
        section = config.get("reproduce")
        require(isinstance(section, dict), "config has no reproduce section (ratio_rtol, time_rtol; "
                                           "config/config.yaml has one to copy)")
        return cls(ratio=float(section[TOLERANCE_KEYS["ratio"]]), time=float(section[TOLERANCE_KEYS["time"]]))

    def of(self, quantity: str) -> float | None:
        return {"ratio": self.ratio, "time": self.time}.get(quantity)


def measured_folder(config: dict, hw: str | None) -> Path:
    """The re-measured folder of config ``reproduce.measured``: as written, or with ``auto``
    results/<hw> (``hw``: hardware.target's slug, None without a GPU: the reference's folder)."""
    value = config["reproduce"]["measured"]
    if value != MEASURED_AUTO:
        return Path(value)
    return Path("results") / (hw or config["hardware"]["reference"])


@dataclass(frozen=True)
class Item:
    """One compared figure of one side: ``quantity`` is ratio, time or table (exact)."""

    name: str
    group: str
    quantity: str
    hardware: bool          # depends on the GPU that measured it
    value: float | None
    verdict: str | None


@dataclass(frozen=True)
class Side:
    """What one results folder holds for the comparison."""

    folder: Path
    gpu: str
    items: dict[str, Item]
    tables: dict[str, pd.DataFrame]


# ---- reading ----------------------------------------------------------------------------------

def read_json(path: Path):
    """A JSON file, or one line saying why it cannot be read."""
    require(path.is_file(), f"{path} is missing (the claims command writes it: snakemake {path})")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PKVError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None


def _read_table(path: Path) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt or foreign file
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise PKVError(f"cannot read {path}: {type(exc).__name__}: {first}") from None


def _holds(flag) -> str:
    return NOT_MEASURED if flag is None else HOLDS if flag else FAILS


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) else None


def _median(values) -> float | None:
    numbers = [v for v in (_number(x) for x in values) if v is not None]
    return float(pd.Series(numbers).median()) if numbers else None


def claim_items(payload: dict) -> list[Item]:
    """The claims (fair figure, verdict) and every target of a claims.json payload."""
    require(isinstance(payload.get("claims"), list), "claims.json has no claims list")
    out = []
    for claim in payload["claims"]:
        require(isinstance(claim, dict) and "id" in claim and "verdict" in claim,
                "claims.json: a claim lacks its id or verdict")
        fair = claim.get("fair") or {}
        out.append(Item(f"{claim['id']} {claim.get('title', '')}".strip(), "claims", "ratio",
                        not claim.get("protocol_free", False), _number(fair.get("value")), claim["verdict"]))
    return out + _target_items(payload)


def _target_items(payload: dict) -> list[Item]:
    out = []

    def add(group, name, value, verdict, quantity="ratio"):
        out.append(Item(name, group, quantity, True, _number(value), verdict))

    engine = payload.get("engine") or {}
    for case in engine.get("mid_range", []):
        add("engine", f"engine {case['case']} vs baselines", case.get("ratio"),
            _holds(case.get("holds") if case.get("measured", True) else None))
    for case in engine.get("ceiling", []):
        add("engine ceiling", f"engine ceiling {case['case']}", case.get("frac"), _holds(case.get("holds")))
    if engine.get("floor"):
        add("engine", "engine min vs baselines", (engine["floor"].get("min") or {}).get("ratio"),
            _holds(engine["floor"].get("holds")))
    host = engine.get("host") or {}
    if host:
        add("engine", "engine host loop (median us)", host.get("median_us"),
            _holds(host.get("holds") if host.get("measured") else None), quantity="time")
    floor = payload.get("floor") or {}
    for check, (cases, figure) in FLOOR_CHECKS.items():
        if isinstance(floor.get(check), dict):
            add("floor", f"floor {check} (median)", _median(c.get(figure) for c in floor[check].get(cases, [])),
                floor[check].get("verdict"))
    e2e = payload.get("e2e") or {}
    if e2e.get("measured"):
        step, gain = e2e.get("step") or {}, e2e.get("gain") or {}
        add("e2e", "e2e step (min ratio)", (step.get("min") or {}).get("ratio"), _holds(step.get("holds")))
        add("e2e", "e2e gain (median gap)", gain.get("gap_median"), _holds(gain.get("holds")))
        for rest in e2e.get("rest", []):
            add("e2e", f"e2e rest {rest['model']}/{rest['kernels']}", rest.get("frac"), _holds(rest.get("holds")))
    for protocol, entry in sorted(((payload.get("adaptive") or {}).get("protocols") or {}).items()):
        add("adaptive", f"adaptive {protocol} min", (entry.get("min") or {}).get("ratio"),
            _holds(entry.get("holds_floor")))
        add("adaptive", f"adaptive {protocol} geomean", (entry.get("geomean") or {}).get("ratio"),
            _holds(entry.get("holds_geomean")))
    return out


def gpu_name(folder: Path, payload: dict) -> str:
    """The GPU the folder's runs name in provenance.json, else claims.json's ``gpu``."""
    path = folder / "provenance.json"
    if path.is_file():
        records = read_json(path)
        require(isinstance(records, dict), f"{path} must hold {{run_id: {{...}}}}")
        names = sorted({str(r["gpu"]) for r in records.values() if isinstance(r, dict) and r.get("gpu")})
        if names:
            return " / ".join(names)
    return str(payload.get("gpu") or folder.name)


def read_side(folder: str | Path, counters: str | Path | None = None) -> Side:
    """claims.json, provenance.json and the counters tables of one results folder."""
    folder = Path(folder)
    require(folder.is_dir(), f"results folder {folder} does not exist")
    counters = Path(counters) if counters is not None else folder.parent / "counters"
    require(counters.is_dir(), f"counters folder {counters} does not exist")
    payload = read_json(folder / "claims.json")
    require(isinstance(payload, dict), f"{folder / 'claims.json'} must hold a JSON object")
    try:
        found = claim_items(payload)
    except (KeyError, TypeError, AttributeError) as exc:   # an entry without the fields DATA.md lists
        raise PKVError(f"{folder / 'claims.json'} is not a claims.json this version reads: "
                       f"{type(exc).__name__}: {exc}") from None
    items = {}
    for item in found:
        require(item.name not in items, f"{folder / 'claims.json'}: {item.name} appears twice")
        items[item.name] = item
    tables = {f"counters/{p.name}": _read_table(p) for p in sorted(counters.glob("*.parquet"))
              if not p.name.startswith(".")}
    return Side(folder, gpu_name(folder, payload), items, tables)


# ---- comparing --------------------------------------------------------------------------------

def table_difference(committed: pd.DataFrame, measured: pd.DataFrame) -> str:
    """'' when the tables are equal cell for cell (columns, dtypes, order; NaN equals NaN), else
    where they first differ."""
    if list(committed.columns) != list(measured.columns):
        return f"columns differ: {list(committed.columns)} vs {list(measured.columns)}"
    if len(committed) != len(measured):
        return f"{len(committed)} vs {len(measured)} rows"
    for name in committed.columns:
        a, b = committed[name].reset_index(drop=True), measured[name].reset_index(drop=True)
        if a.dtype != b.dtype:
            return f"column {name}: dtype {a.dtype} vs {b.dtype}"
        same = (a == b) | (a.isna() & b.isna())
        if not bool(same.all()):
            row = int((~same).to_numpy().nonzero()[0][0])
            return f"column {name}, row {row}: {a.iloc[row]!r} vs {b.iloc[row]!r}"
    return ""


def _relative(committed: float | None, measured: float | None) -> float | None:
    """|measured - committed| / |committed|; None without both figures, or against a committed 0."""
    if committed is None or measured is None:
        return None
    if committed == 0:
        return 0.0 if measured == 0 else None
    return abs(measured - committed) / abs(committed)


def compare_item(name: str, committed: Item | None, measured: Item | None, tolerances: Tolerances,
                 same_gpu: bool) -> dict:
    """One row of reproduction.json's ``items`` (docs/DATA.md)."""
    item = committed or measured
    tolerance = tolerances.of(item.quantity)
    row = {"item": name, "group": item.group, "quantity": item.quantity, "hardware": item.hardware,
           "committed": None if committed is None else {"value": committed.value, "verdict": committed.verdict},
           "measured": None if measured is None else {"value": measured.value, "verdict": measured.verdict},
           "rel_diff": None, "tolerance": tolerance}
    if committed is None or measured is None:
        agrees, note = False, "missing from the " + ("committed" if committed is None else "re-measured") + " results"
    else:
        row["rel_diff"] = _relative(committed.value, measured.value)
        same_verdict = committed.verdict == measured.verdict
        if committed.value is None or measured.value is None:
            within = committed.value is None and measured.value is None
        else:
            within = row["rel_diff"] is not None and row["rel_diff"] <= tolerance
        agrees = same_verdict and within
        note = "; ".join(n for n in (
            "" if same_verdict else f"verdict {committed.verdict} -> {measured.verdict}",
            "" if within else f"figure off by more than {tolerance:.0%}") if n)
    judged = same_gpu or not item.hardware
    if not judged:
        note = DIFFERENT_GPU
    return {**row, "judged": judged, "agrees": agrees if judged else None, "note": note}


def compare_table(name: str, committed: pd.DataFrame | None, measured: pd.DataFrame | None) -> dict:
    if committed is None or measured is None:
        agrees = False
        note = "missing from the " + ("committed" if committed is None else "re-measured") + " results"
    else:
        note = table_difference(committed, measured)
        agrees = not note
    rows = lambda t: None if t is None else {"rows": int(len(t)), "columns": int(len(t.columns))}
    return {"item": name, "group": "counters", "quantity": "table", "hardware": False, "committed": rows(committed),
            "measured": rows(measured), "rel_diff": None, "tolerance": 0, "judged": True, "agrees": agrees,
            "note": note}


def compare(reference: Side, measured: Side, tolerances: Tolerances) -> dict:
    """The reproduction.json payload (docs/DATA.md): every claim, target and counters table."""
    same_gpu = reference.gpu == measured.gpu
    names = list(reference.items) + [n for n in measured.items if n not in reference.items]
    items = [compare_item(n, reference.items.get(n), measured.items.get(n), tolerances, same_gpu) for n in names]
    tables = sorted(set(reference.tables) | set(measured.tables))
    items += [compare_table(n, reference.tables.get(n), measured.tables.get(n)) for n in tables]
    judged = [i for i in items if i["judged"]]
    disagree = [i["item"] for i in judged if not i["agrees"]]
    return {"format": FORMAT, "reference": {"folder": str(reference.folder), "gpu": reference.gpu},
            "measured": {"folder": str(measured.folder), "gpu": measured.gpu}, "same_gpu": same_gpu,
            "tolerances": {TOLERANCE_KEYS[q]: tolerances.of(q) for q in TOLERANCE_KEYS},
            "counts": {"items": len(items), "judged": len(judged), "agree": len(judged) - len(disagree),
                       "disagree": len(disagree), "not_judged": len(items) - len(judged)},
            "disagree": disagree, "agrees": not disagree, "items": items}


# ---- the summary ------------------------------------------------------------------------------

#: Groups with more items than this print as one line (plus a line per item that disagrees).
SUMMARY_GROUP_LINES = 12


def side_text(side: dict | None, quantity: str) -> str:
    """One side of a reproduction.json item as the table prints it: figure and verdict, or rows."""
    if side is None:
        return "missing"
    if quantity == "table":
        return f"{side['rows']} rows"
    value = side["value"]
    figure = "-" if value is None else f"{value:.1f} us" if quantity == "time" else f"{value:.3f}"
    return f"{figure} {side['verdict']}"


def agrees_text(row: dict) -> str:
    return "not judged" if not row["judged"] else "yes" if row["agrees"] else "NO"


def summary_lines(payload: dict) -> list[str]:
    """The one-screen table: item, committed, re-measured, agrees (a group of many items as one line)."""
    rows, groups = [], {}
    for row in payload["items"]:
        groups.setdefault(row["group"], []).append(row)
    for group, members in groups.items():
        if len(members) <= SUMMARY_GROUP_LINES:
            rows += [(r["item"], side_text(r["committed"], r["quantity"]), side_text(r["measured"], r["quantity"]),
                      agrees_text(r)) for r in members]
            continue
        judged = [r for r in members if r["judged"]]
        agree = sum(bool(r["agrees"]) for r in judged)
        rows.append((f"{group} ({len(members)} items)", "", "",
                     f"{agree}/{len(judged)} yes" if judged else "not judged"))
        rows += [(f"  {r['item']}", side_text(r["committed"], r["quantity"]), side_text(r["measured"], r["quantity"]),
                  agrees_text(r)) for r in judged if not r["agrees"]]
    header = ("item", "committed", "re-measured", "agrees")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(3)]
    fmt = lambda r: f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}"
    ref, new, counts = payload["reference"], payload["measured"], payload["counts"]
    gpus = f"{ref['gpu']} vs {new['gpu']}" + ("" if payload["same_gpu"] else f" ({DIFFERENT_GPU} for the GPU's items)")
    verdict = "reproduced" if payload["agrees"] else f"{counts['disagree']} judged item(s) disagree"
    total = f"{counts['agree']}/{counts['judged']} judged items agree, {counts['not_judged']} not judged: {verdict}"
    return [f"{new['folder']} against {ref['folder']}: {gpus}", fmt(header)] + [fmt(r) for r in rows] + [total]
