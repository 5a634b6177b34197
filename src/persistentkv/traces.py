"""Seeded serving traces: which requests are active at each decode step, and their real lengths.

The five published generators reproduce the draws of the paper's artifact exactly. That artifact
drew every value with ``torch.randint(lo, hi + 1, (1,), generator=g)`` on a CPU generator seeded
with ``seed``; PyTorch's CPU generator is MT19937 with the reference ``init_genrand`` seeding, and
``randint`` maps one 32-bit output ``u`` to ``lo + u % (hi + 1 - lo)`` (for spans below 2**28,
every published range; wider spans use two outputs). NumPy's legacy
``RandomState(seed)`` is the same MT19937 with the same seeding, so :class:`TorchCompatibleRNG`
gives the identical stream without importing torch (tests hold it equal to torch when torch is
installed, and to a stored fixture when it is not).

Request ``i`` arrives at step ``i // max_active``. At step ``s`` the active set is the requests
with ``arrival <= s < arrival + decode_steps``, in id order, truncated to ``max_active``; a
request's length there is ``prompt_len + (s - arrival)``. Steps with no active request are
skipped, and the trace keeps its first ``num_steps`` non-empty steps.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import PKVError, require
from .spec import MAX_SEQ_LEN, integer_array, is_integer

GENERATED_KINDS = ("uniform", "bimodal", "zipf", "bucketed", "homogeneous")
TRACE_KINDS = GENERATED_KINDS + ("file",)
#: Offsets the artifact adds to a trace seed for its other generators (pages, K/V, Q).
PAGE_SEED_OFFSET = 99
KV_SEED_OFFSET = 7
Q_SEED_OFFSET = 2026
#: Seeds must leave room for the offsets inside MT19937's 32-bit seed.
MAX_SEED = 2**32 - 1 - Q_SEED_OFFSET
#: Published prompts are rounded up to a multiple of 16 tokens (the paper's page size).
PROMPT_ROUNDING = 16
FILE_COLUMNS = ("request_id", "arrival_step", "prompt_len", "decode_steps")
#: torch's CPU randint switches from one 32-bit draw to random64() at this span
#: (ATen/core/DistributionsHelper.h, uniform_int_from_to_distribution, public builds).
RANDINT_64BIT_SPAN = 2**28
#: Request ids, arrivals, prompts and decode counts are int32 wherever they go (block tables,
#: item words, Parquet columns).
INT32_MAX = 2**31 - 1
#: A trace is drawn or read in full before its steps are made: at most this many requests (a
#: file's lines; ~0.5 s to draw for a generator).
MAX_TRACE_REQUESTS = 2**16
#: At most this many row lengths (one per active request per step) in a trace's steps: 2**20 of
#: them take 0.3-7 s to make (from wide steps to a million one-row steps) and 10-20 MB of JSON.
#: A longer trace is refused before any step is made (a file with decode_steps in the billions
#: would otherwise never return); ``num_steps`` keeps the first steps of one.
MAX_TRACE_ROWS = 2**20
#: A CSV integer: ASCII digits with an optional sign (Python's int() also takes "1_000" and
#: non-ASCII digits, which a trace file never means).
_CSV_INTEGER = re.compile(r"[+-]?[0-9]+")


def check_seed(seed: object) -> int:
    if not is_integer(seed):
        raise PKVError(f"seed must be an integer, got {seed!r}")
    require(0 <= seed <= MAX_SEED, f"seed={seed} is out of range [0, {MAX_SEED}]")
    return int(seed)


class TorchCompatibleRNG:
    """The draws of ``torch.Generator().manual_seed(seed)`` on the CPU, without torch."""

    def __init__(self, seed: int):
        require(is_integer(seed) and 0 <= seed < 2**32, f"generator seed {seed!r} is not an integer in [0, 2**32)")
        self._state = np.random.RandomState(int(seed))

    def _u32(self, size: int | None = None):
        return self._state.randint(0, 2**32, size=size, dtype=np.uint64)

    def randint(self, low: int, high_inclusive: int) -> int:
        """One draw of ``torch.randint(low, high_inclusive + 1, (1,))``."""
        span = high_inclusive + 1 - low
        require(0 < span < 2**63, f"randint span {span} out of range")
        if span >= RANDINT_64BIT_SPAN:
            # torch draws random64() here: two outputs, the first is the high word.
            high, low_word = (int(u) for u in self._u32(2))
            return low + ((high << 32) | low_word) % span
        return low + int(self._u32()) % span

    def randperm(self, n: int) -> np.ndarray:
        """``torch.randperm(n)``: the swap-based shuffle PyTorch's CPU kernel uses for n < 2**32/20."""
        require(is_integer(n) and 0 <= n < (2**32 - 1) // 20, f"randperm size {n!r} out of range")
        perm = list(range(n))
        if n > 1:
            draws = self._u32(n - 1).tolist()
            for i in range(n - 1):
                j = i + draws[i] % (n - i)
                perm[i], perm[j] = perm[j], perm[i]
        return np.asarray(perm, dtype=np.int64)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Request:
    id: int
    arrival: int
    prompt_len: int
    decode_steps: int

    def __post_init__(self) -> None:
        # if/raise rather than require(): a trace makes many, and require() formats its message first
        for name in ("id", "arrival", "prompt_len", "decode_steps"):
            value = getattr(self, name)
            if not is_integer(value):
                raise PKVError(f"request {self.id!r}: {name} must be an integer, got {value!r}")
            if not 0 <= value <= INT32_MAX:
                raise PKVError(f"request {self.id}: {name}={value} is out of range [0, {INT32_MAX}]")
            object.__setattr__(self, name, int(value))
        if self.max_len > MAX_SEQ_LEN:
            raise PKVError(f"request {self.id}: prompt_len + decode_steps = {self.max_len} tokens exceeds the "
                           f"longest row the engine addresses ({MAX_SEQ_LEN} tokens)")

    @property
    def max_len(self) -> int:
        """Tokens the request holds at its last decode step, plus the token it writes there."""
        return self.prompt_len + self.decode_steps


@dataclass(frozen=True)
class Step:
    """One decode step: active request ids (id order) and their real lengths N*_i."""

    index: int
    request_ids: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        # zip() over unequal sequences would drop rows silently; the elements' types are checked
        # where they enter (Trace.from_json, cache.batch_for_step), with NumPy. if/raise: a trace
        # makes up to MAX_TRACE_ROWS steps, and require() would format each message first.
        ids, lengths = self.request_ids, self.lengths
        if not (isinstance(ids, (tuple, list)) and isinstance(lengths, (tuple, list))):
            raise PKVError(f"step {self.index!r}: request_ids and lengths must be tuples, got "
                           f"{type(ids).__name__} and {type(lengths).__name__}")
        if not len(ids) == len(lengths) >= 1:
            raise PKVError(f"step {self.index!r} needs one length per request id and at least one row, got "
                           f"{len(ids)} ids and {len(lengths)} lengths")

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True)
class Trace:
    name: str
    kind: str
    seed: int
    max_active: int
    requests: tuple[Request, ...]
    steps: tuple[Step, ...]
    params: dict = field(default_factory=dict)

    def to_json(self) -> str:
        """Canonical JSON: the same trace always serialises to the same bytes."""
        payload = {
            "format": "persistentkv-trace/1",
            "name": self.name,
            "kind": self.kind,
            "seed": self.seed,
            "max_active": self.max_active,
            "params": self.params,
            "requests": [[r.id, r.arrival, r.prompt_len, r.decode_steps] for r in self.requests],
            "steps": [[s.index, list(s.request_ids), list(s.lengths)] for s in self.steps],
        }
        return json.dumps(payload, sort_keys=True, separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> "Trace":
        """The trace a file holds (``to_json``'s output, as text or UTF-8 bytes), every field checked."""
        require(isinstance(text, (str, bytes)), f"a trace is read from JSON text, got {type(text).__name__}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PKVError(f"not a persistentkv trace file (invalid JSON: {exc.msg} at line {exc.lineno})") from None
        except UnicodeDecodeError as exc:
            raise PKVError(f"not a persistentkv trace file (not UTF-8: {exc.reason} at byte {exc.start})") from None
        except RecursionError:
            raise PKVError("not a persistentkv trace file (JSON nested too deeply)") from None
        require(isinstance(data, dict) and data.get("format") == "persistentkv-trace/1",
                "not a persistentkv trace file")
        try:
            return cls(**_trace_fields(data))
        except PKVError as exc:
            raise PKVError(f"malformed persistentkv trace file ({exc})") from None

    def request(self, request_id: int) -> Request:
        return self._by_id()[request_id]

    def _by_id(self) -> dict[int, Request]:
        cached = self.__dict__.get("_by_id_cache")
        if cached is None:
            cached = {r.id: r for r in self.requests}
            object.__setattr__(self, "_by_id_cache", cached)
        return cached


def _trace_fields(data: dict) -> dict:
    """Trace fields from a parsed trace file, each checked: a file may hold anything. (if/raise in
    the loops: require() would format its message for every request and step.)"""
    missing = [key for key in ("name", "kind", "seed", "max_active", "requests", "steps", "params") if key not in data]
    require(not missing, f"missing {', '.join(missing)}")
    for key, kind in (("name", str), ("params", dict), ("requests", list), ("steps", list)):
        require(isinstance(data[key], kind), f"{key} must be a JSON {kind.__name__}, got {type(data[key]).__name__}")
    require(isinstance(data["kind"], str) and data["kind"] in TRACE_KINDS,
            f"kind {data['kind']!r} is not one of {', '.join(TRACE_KINDS)}")
    for entry in data["requests"]:
        if not (isinstance(entry, list) and len(entry) == 4):
            raise PKVError(f"a request is [id, arrival, prompt_len, decode_steps], got {str(entry)[:60]}")
    requests = tuple(Request(*entry) for entry in data["requests"])
    known = {r.id for r in requests}
    require(len(known) == len(requests), "request ids must be distinct")
    steps = []
    for entry in data["steps"]:
        if not (isinstance(entry, list) and len(entry) == 3 and is_integer(entry[0]) and entry[0] >= 0):
            raise PKVError(f"a step is [index, request ids, lengths], got {str(entry)[:60]}")
        ids = integer_array(f"step {entry[0]} request ids", entry[1], 0, INT32_MAX).tolist()
        lengths = integer_array(f"step {entry[0]} lengths", entry[2], 1, MAX_SEQ_LEN).tolist()
        unknown = set(ids) - known
        if unknown:
            raise PKVError(f"step {entry[0]} names request {min(unknown)}, which the file does not list")
        steps.append(Step(entry[0], tuple(ids), tuple(lengths)))
    return {"name": data["name"], "kind": data["kind"], "seed": check_seed(data["seed"]),
            "max_active": _check_count("max_active", data["max_active"]), "requests": requests,
            "steps": tuple(steps), "params": data["params"]}


def _draw_request(kind: str, index: int, rng: TorchCompatibleRNG) -> tuple[int, int]:
    """(prompt_len before rounding, decode_steps) for request ``index``; draw order as published."""
    if kind == "uniform":
        return rng.randint(4096, 32768), rng.randint(16, 96)
    if kind == "bimodal":  # every 4th request (ids 0, 4, 8, ...) is long
        if index % 4 == 0:
            return rng.randint(24576, 65536), rng.randint(32, 128)
        return rng.randint(2048, 12288), rng.randint(8, 64)
    if kind == "zipf":
        rank = rng.randint(1, 32)
        prompt = int(2048 + 65536 / math.sqrt(rank))
        jitter = rng.randint(-512, 512)
        return max(1024, prompt + jitter), rng.randint(8, 128)
    if kind == "bucketed":
        return (8192, 16384, 32768, 65536)[index % 4], rng.randint(32, 96)
    if kind == "homogeneous":
        return 32768, rng.randint(32, 96)
    raise PKVError(f"unknown trace kind {kind!r}; expected one of {', '.join(TRACE_KINDS)}")


def _live_spans(arrivals: np.ndarray, ends: np.ndarray, max_active: int,
               num_steps: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The trace's non-empty steps as spans ``[start, stop)`` over which the active set is constant
    (no request arrives or ends inside), clipped to the first ``num_steps`` steps; refused (one
    line) when they would hold more than :data:`MAX_TRACE_ROWS` row lengths.

    arrivals, ends: int64 [R], each request's first step and the step after its last.
    Returns (start, stop), int64 [K] each, in step order. Counted in O(R log R), without
    walking the steps, so a request decoding for billions of steps is refused at once.
    """
    bounds = np.unique(np.concatenate([arrivals, ends]))
    start, stop = bounds[:-1], bounds[1:]
    active = (np.searchsorted(np.sort(arrivals), start, side="right")
              - np.searchsorted(np.sort(ends), start, side="right"))
    keep = active > 0
    start, stop, active = start[keep], stop[keep], active[keep]
    if num_steps is not None:
        before = np.cumsum(stop - start) - (stop - start)    # non-empty steps ahead of each span
        keep = before < num_steps
        start, stop, before = start[keep], stop[keep], before[keep]
        stop = np.minimum(stop, start + (num_steps - before))
        active = active[keep]
    rows = int(((stop - start) * np.minimum(active, max_active)).sum())
    require(rows <= MAX_TRACE_ROWS,
            f"the trace's {int((stop - start).sum())} active steps would hold {rows} row lengths, more than "
            f"the {MAX_TRACE_ROWS} a trace may hold; keep its first steps with num_steps "
            "(--num-steps for a file, num_steps in its config entry)")
    return start, stop


def active_steps(requests: tuple[Request, ...], max_active: int, num_steps: int | None) -> tuple[Step, ...]:
    """Apply the published active-set rule (module docstring) to a request list."""
    if not requests:
        return ()
    max_active = _check_count("max_active", max_active)
    if num_steps is not None:
        num_steps = _check_count("num_steps", num_steps)
    ordered = sorted(requests, key=lambda r: r.id)
    arrivals = np.array([r.arrival for r in ordered], dtype=np.int64)
    ends = arrivals + np.array([r.decode_steps for r in ordered], dtype=np.int64)
    prompts = np.array([r.prompt_len for r in ordered], dtype=np.int64)
    ids = np.array([r.id for r in ordered], dtype=np.int64)
    starts, stops = _live_spans(arrivals, ends, max_active, num_steps)
    steps: list[Step] = []
    for first, stop in zip(starts.tolist(), stops.tolist()):
        live = np.flatnonzero((arrivals <= first) & (first < ends))[:max_active]
        request_ids = tuple(ids[live].tolist())
        offset = prompts[live] - arrivals[live]           # a row's length at step s is offset + s
        steps.extend(Step(s, request_ids, tuple((offset + s).tolist())) for s in range(first, stop))
    return tuple(steps)


def _check_count(name: str, value: object, minimum: int = 1, maximum: int | None = None) -> int:
    if not is_integer(value):
        raise PKVError(f"{name} must be an integer, got {value!r}")
    require(value >= minimum, f"{name} must be >= {minimum}, got {value}")
    require(maximum is None or value <= maximum, f"{name}={value} exceeds the maximum of {maximum}")
    return int(value)


def generate(kind: str, seed: int, num_requests: int, max_active: int,
             num_steps: int | None = None, name: str | None = None) -> Trace:
    """A published trace kind (uniform, bimodal, zipf, bucketed, homogeneous)."""
    require(kind in GENERATED_KINDS,
            f"unknown trace kind {kind!r}; expected one of {', '.join(GENERATED_KINDS)} (or 'file')")
    seed = check_seed(seed)
    num_requests = _check_count("num_requests", num_requests, maximum=MAX_TRACE_REQUESTS)
    max_active = _check_count("max_active", max_active)
    if num_steps is not None:
        num_steps = _check_count("num_steps", num_steps)
    rng = TorchCompatibleRNG(seed)
    requests = []
    for index in range(num_requests):
        prompt, decode = _draw_request(kind, index, rng)
        prompt = max(PROMPT_ROUNDING, round_up(prompt, PROMPT_ROUNDING))
        requests.append(Request(index, index // max_active, prompt, decode))
    requests_t = tuple(requests)
    return Trace(name or f"{kind}_b{max_active}", kind, seed, max_active, requests_t,
                 active_steps(requests_t, max_active, num_steps),
                 {"num_requests": num_requests, "num_steps": num_steps})


def _parse_int(value: str, column: str, line: int, path: Path) -> int:
    text = (value or "").strip()
    if _CSV_INTEGER.fullmatch(text) is None:
        raise PKVError(f"{path}:{line}: column {column} must be an integer, got {text!r}")
    # the digit count first: int() refuses strings of over 4300 digits with its own ValueError
    if len(text.lstrip("+-0")) > 10 or abs(int(text)) > INT32_MAX:
        shown = text if len(text) <= 20 else text[:20] + "..."
        raise PKVError(f"{path}:{line}: column {column} must be at most {INT32_MAX}, got {shown}")
    return int(text)


def _path(path: object, what: str) -> Path:
    require(isinstance(path, (str, Path)), f"{what} must be a path, got {path!r}")
    return Path(path)


def load_requests_csv(path: str | Path) -> tuple[Request, ...]:
    """Read a user's trace: CSV with columns request_id, arrival_step, prompt_len, decode_steps.

    Every field is an ASCII integer (``1_000``, ``1e3`` and ``0x10`` are refused; spaces around a
    field are stripped), of at most ``INT32_MAX``; a request's prompt_len + decode_steps is at most
    ``MAX_SEQ_LEN``; at most :data:`MAX_TRACE_REQUESTS` requests.
    """
    path = _path(path, "trace file")
    require(path.is_file(), f"trace file {path} does not exist")
    try:
        # utf-8-sig: spreadsheet exports start with a byte-order mark that would hide request_id.
        with path.open(newline="", encoding="utf-8-sig") as handle:
            return _read_requests(csv.DictReader(handle), path)
    except UnicodeDecodeError as exc:
        raise PKVError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    except csv.Error as exc:
        raise PKVError(f"{path}: not a readable CSV file ({exc})") from None


def _read_requests(reader: csv.DictReader, path: Path) -> tuple[Request, ...]:
    require(reader.fieldnames is not None,
            f"{path}: the file is empty; expected a header {','.join(FILE_COLUMNS)}")
    header = [h.strip() for h in reader.fieldnames]
    missing = [c for c in FILE_COLUMNS if c not in header]
    require(not missing, f"{path}: missing column(s) {', '.join(missing)}; "
                         f"expected {', '.join(FILE_COLUMNS)}")
    requests: list[Request] = []
    seen: set[int] = set()
    for row in reader:
        line = reader.line_num  # physical line, so blank lines do not shift the number we report
        require(None not in row, f"{path}:{line}: more fields than the header's {len(header)}")
        row = {k.strip(): v for k, v in row.items()}
        rid, arrival, prompt, decode = (_parse_int(row.get(c), c, line, path) for c in FILE_COLUMNS)
        require(rid >= 0, f"{path}:{line}: request_id must be >= 0, got {rid}")
        require(rid not in seen, f"{path}:{line}: duplicate request_id {rid}")
        require(arrival >= 0, f"{path}:{line}: arrival_step must be >= 0, got {arrival}")
        require(prompt >= 1, f"{path}:{line}: prompt_len must be >= 1, got {prompt}")
        require(decode >= 1, f"{path}:{line}: decode_steps must be >= 1, got {decode}")
        require(len(requests) < MAX_TRACE_REQUESTS, f"{path}:{line}: more than {MAX_TRACE_REQUESTS} requests")
        seen.add(rid)
        try:
            requests.append(Request(rid, arrival, prompt, decode))
        except PKVError as exc:
            raise PKVError(f"{path}:{line}: {exc}") from None
    require(requests, f"{path}: the trace has no requests")
    return tuple(sorted(requests, key=lambda r: r.id))


def from_file(path: str | Path, max_active: int, num_steps: int | None = None, seed: int = 0,
              name: str | None = None) -> Trace:
    """A user's trace file under the published active-set rule (arrivals come from the file)."""
    path = _path(path, "trace file")
    max_active = _check_count("max_active", max_active)
    if num_steps is not None:
        num_steps = _check_count("num_steps", num_steps)
    requests = load_requests_csv(path)
    return Trace(name or Path(path).stem, "file", check_seed(seed), max_active, requests,
                 active_steps(requests, max_active, num_steps),
                 {"path": Path(path).name, "num_requests": len(requests), "num_steps": num_steps})


def build(entry: dict, seed: int, base_dir: str | Path = ".") -> Trace:
    """A trace from one config entry (see config/schema.yaml, ``traces``)."""
    require(isinstance(entry, dict), f"a trace entry is a mapping of its keys, got {entry!r}")
    needed = ("name", "kind", "max_active") + (("path",) if entry.get("kind") == "file" else ("num_requests",))
    missing = [key for key in needed if key not in entry]
    require(not missing, f"trace entry {entry.get('name', '')!r} lacks {', '.join(missing)}")
    kind = entry["kind"]
    if kind == "file":
        return from_file(Path(base_dir) / entry["path"], entry["max_active"], entry.get("num_steps"),
                         seed=seed, name=entry["name"])
    return generate(kind, seed, entry["num_requests"], entry["max_active"], entry.get("num_steps"),
                    name=entry["name"])


def write_trace(trace: Trace, path: str | Path) -> None:
    from .io import atomic_write_text

    atomic_write_text(path, trace.to_json())


def read_trace(path: str | Path) -> Trace:
    path = _path(path, "trace")
    require(path.is_file(), f"trace {path} does not exist")
    try:
        return Trace.from_json(path.read_bytes())
    except PKVError as exc:
        raise PKVError(f"{path}: {exc}") from None


def sampled_steps(trace: Trace, count: int) -> list[int]:
    """``count`` indices into ``trace.steps``, for validation: the first step, the one with the most
    tokens (the earliest of equals), then evenly spaced others, in trace order (deterministic;
    all of them when the trace has no more). The CPU and the GPU validation both sample with it.

    Worked number: 9 steps, the last the heaviest, count 4: 0 and 8, then np.linspace(0, 8, 4)
    rounds to 0, 3, 5, 8, which adds 3 and 5: [0, 3, 5, 8].
    """
    require(count >= 1, f"steps_per_trace must be >= 1, got {count}")
    n = len(trace.steps)
    if n == 0:
        return []
    chosen = [0]
    heaviest = int(np.argmax([s.total_tokens for s in trace.steps]))
    if heaviest not in chosen:
        chosen.append(heaviest)
    for x in np.linspace(0, n - 1, num=count):
        if len(chosen) >= min(count, n):
            break
        if int(round(x)) not in chosen:
            chosen.append(int(round(x)))
    for i in range(n):  # fill up when rounding collided
        if len(chosen) >= min(count, n):
            break
        if i not in chosen:
            chosen.append(i)
    return sorted(chosen[:count])
