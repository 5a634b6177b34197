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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import PKVError, require

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


def check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise PKVError(f"seed must be an integer, got {seed!r}")
    require(0 <= seed <= MAX_SEED, f"seed={seed} is out of range [0, {MAX_SEED}]")
    return int(seed)


class TorchCompatibleRNG:
    """The draws of ``torch.Generator().manual_seed(seed)`` on the CPU, without torch."""

    def __init__(self, seed: int):
        require(0 <= seed < 2**32, f"generator seed {seed} is out of range [0, 2**32)")
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
        require(0 <= n < (2**32 - 1) // 20, f"randperm size {n} out of range")
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
    def from_json(cls, text: str) -> "Trace":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PKVError(f"not a persistentkv trace file (invalid JSON: {exc.msg} at line {exc.lineno})") from None
        require(isinstance(data, dict) and data.get("format") == "persistentkv-trace/1",
                "not a persistentkv trace file")
        try:
            return cls(
                name=data["name"], kind=data["kind"], seed=data["seed"], max_active=data["max_active"],
                requests=tuple(Request(*r) for r in data["requests"]),
                steps=tuple(Step(s[0], tuple(s[1]), tuple(s[2])) for s in data["steps"]),
                params=data["params"],
            )
        except (KeyError, TypeError, IndexError) as exc:
            raise PKVError(f"malformed persistentkv trace file ({type(exc).__name__}: {exc})") from None

    def request(self, request_id: int) -> Request:
        return self._by_id()[request_id]

    def _by_id(self) -> dict[int, Request]:
        cached = self.__dict__.get("_by_id_cache")
        if cached is None:
            cached = {r.id: r for r in self.requests}
            object.__setattr__(self, "_by_id_cache", cached)
        return cached


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


def active_steps(requests: tuple[Request, ...], max_active: int, num_steps: int | None) -> tuple[Step, ...]:
    """Apply the published active-set rule (module docstring) to a request list."""
    if not requests:
        return ()
    ordered = sorted(requests, key=lambda r: r.id)
    arrivals = np.array([r.arrival for r in ordered], dtype=np.int64)
    ends = arrivals + np.array([r.decode_steps for r in ordered], dtype=np.int64)
    prompts = np.array([r.prompt_len for r in ordered], dtype=np.int64)
    ids = np.array([r.id for r in ordered], dtype=np.int64)
    steps: list[Step] = []
    for s in range(int(ends.max())):
        live = np.flatnonzero((arrivals <= s) & (s < ends))[:max_active]
        if live.size == 0:
            continue
        steps.append(Step(s, tuple(int(i) for i in ids[live]),
                          tuple(int(n) for n in prompts[live] + (s - arrivals[live]))))
        if num_steps is not None and len(steps) >= num_steps:
            break
    return tuple(steps)


def _check_count(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise PKVError(f"{name} must be an integer, got {value!r}")
    require(value >= minimum, f"{name} must be >= {minimum}, got {value}")
    return int(value)


def generate(kind: str, seed: int, num_requests: int, max_active: int,
             num_steps: int | None = None, name: str | None = None) -> Trace:
    """A published trace kind (uniform, bimodal, zipf, bucketed, homogeneous)."""
    require(kind in GENERATED_KINDS,
            f"unknown trace kind {kind!r}; expected one of {', '.join(GENERATED_KINDS)} (or 'file')")
    seed = check_seed(seed)
    num_requests = _check_count("num_requests", num_requests)
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
    try:
        return int(text)
    except ValueError:
        raise PKVError(f"{path}:{line}: column {column} must be an integer, got {text!r}") from None


def load_requests_csv(path: str | Path) -> tuple[Request, ...]:
    """Read a user's trace: CSV with columns request_id, arrival_step, prompt_len, decode_steps."""
    path = Path(path)
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
        seen.add(rid)
        requests.append(Request(rid, arrival, prompt, decode))
    require(requests, f"{path}: the trace has no requests")
    return tuple(sorted(requests, key=lambda r: r.id))


def from_file(path: str | Path, max_active: int, num_steps: int | None = None, seed: int = 0,
              name: str | None = None) -> Trace:
    """A user's trace file under the published active-set rule (arrivals come from the file)."""
    max_active = _check_count("max_active", max_active)
    if num_steps is not None:
        num_steps = _check_count("num_steps", num_steps)
    requests = load_requests_csv(path)
    return Trace(name or Path(path).stem, "file", check_seed(seed), max_active, requests,
                 active_steps(requests, max_active, num_steps),
                 {"path": Path(path).name, "num_requests": len(requests), "num_steps": num_steps})


def build(entry: dict, seed: int, base_dir: str | Path = ".") -> Trace:
    """A trace from one config entry (see config/schema.yaml, ``traces``)."""
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
    path = Path(path)
    require(path.is_file(), f"trace {path} does not exist")
    return Trace.from_json(path.read_text())


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
