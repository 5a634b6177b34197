"""The experiment grid: load config/config.yaml, validate it, and answer questions about it.

Validation has two layers. The JSON schema (config/schema.yaml, ``additionalProperties: false``
everywhere) catches unknown keys, wrong types and out-of-range values; the first error becomes one
line naming the key path and the bad value::

    config: traces[1].max_active: 0 is less than the minimum of 1

Cross-field rules the schema cannot express (names that must refer to a trace, distinct seeds,
GQA group sizes that divide the query heads, a trace file that exists, no NaN or infinity, which
every bound of the schema lets through, and the library's own limits on lengths and trace sizes)
follow, also as one line.
The Snakefile and every command that takes ``--config`` go through :func:`load_config` or
:func:`validate_config`, so the workflow and the CLI reject the same inputs with the same words.
"""

from __future__ import annotations

import copy
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from .errors import PKVError, require
from .spec import MAX_SEQ_LEN, AttentionSpec, shapes_cells
from .traces import MAX_TRACE_REQUESTS

#: Default locations, relative to the repository root (the workflow's working directory).
DEFAULT_CONFIG = Path("config/config.yaml")
#: The schema ships in the repository beside the config (the package is installed editable from
#: it); a copy in the working directory's config/ is the fallback.
SCHEMA_PATH = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"

_MAX_VALUE_CHARS = 60
#: YAML 1.1 (PyYAML, Snakemake) reads 1e-3 as a string: a float needs a dot and a signed exponent.
_NUMBER_LIKE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_EXPONENT_NO_DOT = re.compile(r"^[+-]?\d+[eE][+-]?\d+$")


def _short(value: Any) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= _MAX_VALUE_CHARS else text[:_MAX_VALUE_CHARS - 3] + "..."


def key_path(parts) -> str:
    """['traces', 1, 'max_active'] -> 'traces[1].max_active' ('' for the top level)."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@lru_cache(maxsize=4)
def _schema(path: str) -> dict:
    schema_path = Path(path)
    if not schema_path.is_file() and (Path("config") / "schema.yaml").is_file():
        schema_path = Path("config") / "schema.yaml"
    require(schema_path.is_file(), f"config schema {schema_path} does not exist")
    return yaml.safe_load(schema_path.read_text())


@lru_cache(maxsize=4)
def _validator(schema_path: str):
    """Draft 2020-12 validator whose ``integer`` rejects floats: JSON Schema counts 20.0 as an
    integer, but the planner and the generators take Python ints, so YAML's ``20.0`` is an error."""
    from jsonschema import Draft202012Validator, validators

    checker = Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool))
    strict = validators.extend(Draft202012Validator, type_checker=checker)
    return strict(_schema(schema_path))


def _describe(error) -> str:
    """One line for a jsonschema ValidationError: 'key.path: what is wrong with which value'."""
    where = key_path(error.absolute_path) or "(top level)"
    kind = error.validator
    if kind == "additionalProperties" and isinstance(error.instance, dict):
        allowed = set(error.schema.get("properties", {}))
        unknown = sorted(str(k) for k in error.instance if k not in allowed)
        return (f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
                f" (allowed: {', '.join(sorted(allowed))})")
    if kind == "required":
        missing = error.message.split(" is a required property")[0]
        return f"{where}: missing required key {missing}"
    if kind == "type" and isinstance(error.instance, str) and _NUMBER_LIKE.match(error.instance.strip()):
        wanted = error.validator_value if isinstance(error.validator_value, str) else "number"
        article = "an" if wanted[0] in "aeiou" else "a"
        hint = " (YAML reads 1e-3 as text: write 1.0e-3)" if _EXPONENT_NO_DOT.match(error.instance.strip()) else ""
        return f"{where}: {error.instance!r} is a string, not {article} {wanted}{hint}"
    if kind in ("type", "enum", "pattern", "uniqueItems", "minItems", "const"):
        message = error.message
        # jsonschema repeats the whole instance; keep the line short for big values.
        rendered = repr(error.instance)
        if message.startswith(rendered) and len(rendered) > _MAX_VALUE_CHARS:
            message = _short(error.instance) + message[len(rendered):]
        return f"{where}: {message}"
    return f"{where}: {error.message}"


def validate_config(config: Any, base_dir: str | Path = ".", schema_path: str | Path = SCHEMA_PATH) -> dict:
    """Check ``config`` (the parsed YAML) against the schema and the cross-field rules.

    Returns the config unchanged; raises :class:`PKVError` with one line ``config: <key>: <why>``
    at the first problem. ``base_dir`` is where relative trace-file paths are looked up.
    """
    from jsonschema.exceptions import best_match

    error = best_match(_validator(str(schema_path)).iter_errors(config))
    if error is not None:
        raise PKVError(f"config: {_describe(error)}")
    _cross_checks(config, Path(base_dir))
    return config


def _non_finite(value: Any, path: tuple = ()) -> tuple | None:
    """Key path of the first NaN or infinity in ``value`` (YAML's .nan / .inf), else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        found = _non_finite(child, path + (key,))
        if found is not None:
            return found
    return None


def _cross_checks(config: dict, base_dir: Path) -> None:
    def fail(where: str, message: str) -> None:
        raise PKVError(f"config: {where}: {message}")

    where = _non_finite(config)
    if where is not None:
        fail(key_path(where), f"{_short(_at(config, where))} is not a finite number")

    for index, entry in enumerate(config["traces"]):
        if entry.get("num_requests", 0) > MAX_TRACE_REQUESTS:
            fail(f"traces[{index}].num_requests",
                 f"{entry['num_requests']} exceeds the maximum of {MAX_TRACE_REQUESTS}")
    for sweep in ("long_context", "batch_sweep"):
        for index, length in enumerate(config["measure"][sweep]["lengths"]):
            if length > MAX_SEQ_LEN:
                fail(f"measure.{sweep}.lengths[{index}]", f"{length} exceeds the longest row the engine addresses "
                                                          f"({MAX_SEQ_LEN} tokens)")

    try:
        AttentionSpec(**config["spec"])
    except PKVError as exc:
        fail("spec", str(exc))

    names = [entry["name"] for entry in config["traces"]]
    seen: set[str] = set()
    for index, name in enumerate(names):
        if name in seen:
            fail(f"traces[{index}].name", f"{name!r} is used by an earlier trace; names must be unique")
        seen.add(name)

    for index, entry in enumerate(config["traces"]):
        if entry["kind"] == "file":
            path = base_dir / entry["path"]
            if not path.is_file():
                fail(f"traces[{index}].path", f"{entry['path']!r} does not exist (looked in {base_dir.resolve()})")
        elif "path" in entry:
            fail(f"traces[{index}].path", f"only kind 'file' reads a path; {entry['name']!r} is kind {entry['kind']!r}")

    calibration = config["seeds"]["calibration"]
    holdout = config["seeds"]["holdout"]
    if calibration in holdout:
        fail("seeds.holdout", f"contains the calibration seed {calibration}; holdout seeds must differ from it")

    references = [("ablations.buckets.traces", config["ablations"]["buckets"]["traces"]),
                  ("ablations.splits.traces", config["ablations"]["splits"]["traces"]),
                  ("measure.fragmented.traces", config["measure"]["fragmented"]["traces"])]
    for where, listed in references:
        for index, name in enumerate(listed):
            if name not in seen:
                fail(f"{where}[{index}]", f"{name!r} is not a trace name (known: {', '.join(names)})")
    gqa = config["measure"]["gqa_sweep"]
    if gqa["trace"] not in seen:
        fail("measure.gqa_sweep.trace", f"{gqa['trace']!r} is not a trace name (known: {', '.join(names)})")

    num_qo_heads = config["spec"]["num_qo_heads"]
    for index, group in enumerate(gqa["group_sizes"]):
        if num_qo_heads % group:
            fail(f"measure.gqa_sweep.group_sizes[{index}]",
                 f"{group} does not divide spec.num_qo_heads={num_qo_heads} (Hkv = Hq / G must be an integer)")

    shapes = config["measure"].get("bench_shapes")
    if shapes is not None:  # the grid of persistentkv bench-shapes: at least one cell must fit
        cells = list(shapes_cells(AttentionSpec(**config["spec"]), shapes))
        if all(tokens is None for *_, tokens in cells):
            h, g, b, mib = cells[0][:4]
            fail("measure.bench_shapes",
                 f"no cell of the grid fits: each of its {len(cells)} would read rows under one page or over "
                 f"max_tokens_per_row={shapes['max_tokens_per_row']} (the first: Hkv={h} G={g} B={b} at {mib:g} MiB)")

    for where, values in (("ablations.buckets.bucket_tokens", config["ablations"]["buckets"]["bucket_tokens"]),
                          ("ablations.splits.values", config["ablations"]["splits"]["values"])):
        if len(set(values)) != len(values):
            duplicate = next(v for v in values if values.count(v) > 1)
            fail(where, f"{duplicate} is listed twice")


def load_config(path: str | Path = DEFAULT_CONFIG, base_dir: str | Path | None = None) -> dict:
    """Read and validate a config file (YAML). Trace-file paths are relative to ``base_dir``
    (default: the current directory, the repository root when the workflow runs)."""
    require(isinstance(path, (str, Path)), f"config file must be a path, got {path!r}")
    path = Path(path)
    require(path.is_file(), f"config file {path} does not exist")
    try:
        config = yaml.safe_load(path.read_bytes())
    except yaml.reader.ReaderError as exc:  # bytes that are not UTF-8 (or UTF-16) text
        raise PKVError(f"config: {path} is not a text file ({exc.reason} at byte {exc.position})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise PKVError(f"config: {path}:{where} is not valid YAML ({problem})") from None
    require(isinstance(config, dict), f"config: {path} must be a mapping of keys, got {_short(config)}")
    return validate_config(config, base_dir if base_dir is not None else ".")


def _at(config: Any, path: tuple) -> Any:
    for key in path:
        config = config[key]
    return config


def _first_difference(a: Any, b: Any, path: tuple = ()) -> tuple | None:
    """Key path of the first place where ``a`` and ``b`` differ (None when equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if key not in a or key not in b:
                return path + (key,)
            found = _first_difference(a[key], b[key], path + (key,))
            if found is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for index, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, path + (index,))
            if found is not None:
                return found
        return None
    return None if a == b else path


def check_config_file(config: dict, path: str | Path) -> None:
    """The workflow's ``config`` must be exactly what ``path`` holds, because every command reads
    the grid from that file: a ``--config`` override or a partial second ``--configfile`` would
    shape the DAG while the commands ignored it."""
    on_disk = yaml.safe_load(Path(path).read_text())
    where = _first_difference(config, on_disk)
    if where is not None:
        raise PKVError(f"config: {key_path(where) or '(top level)'} differs from {path}, which every command "
                       "reads; put the whole grid in one file and pass --configfile FILE (no --config overrides)")


# ---- questions the workflow and the commands ask ---------------------------------------------

def spec(config: dict) -> AttentionSpec:
    return AttentionSpec(**config["spec"])


def trace_names(config: dict) -> list[str]:
    return [entry["name"] for entry in config["traces"]]


def trace_entry(config: dict, name: str) -> dict:
    """The ``traces`` entry called ``name`` (a copy)."""
    for entry in config["traces"]:
        if entry["name"] == name:
            return copy.deepcopy(entry)
    raise PKVError(f"trace {name!r} is not in the config (known: {', '.join(trace_names(config))})")


def calibration_seed(config: dict) -> int:
    return int(config["seeds"]["calibration"])


def all_seeds(config: dict) -> list[int]:
    """The calibration seed, then the holdout seeds, in config order."""
    return [calibration_seed(config)] + [int(s) for s in config["seeds"]["holdout"]]


def add_config_argument(parser) -> None:
    """The ``--config`` option every command that reads the grid shares."""
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), metavar="YAML",
                        help=f"experiment grid, validated against the schema (default: {DEFAULT_CONFIG})")
