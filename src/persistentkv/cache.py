"""The paged KV cache: page allocation with holes, block tables, and the one physical layout.

Every backend reads the same bytes: K and V are each ``[num_pages, page_size, num_kv_heads,
head_dim]`` (NHD), the layout FlashInfer, vLLM FA3 and TensorRT-LLM XQA read natively. A row's
pages are listed in logical order by a CSR block table (``kv_indptr``, ``kv_indices``), the form
FlashInfer's plan() takes; a padded 2-D table (vLLM, XQA) is derived from it.

Allocation follows the paper: each request reserves ``prompt + decode`` tokens rounded up to
whole pages; with hole fraction ``rho`` the page-id universe has ``ceil(L / (1 - rho))`` ids for
``L`` reserved pages, shuffled by ``randperm`` seeded with ``seed + 99``, and each request (in id
order) takes the next consecutive slice of the shuffled ids: logical order kept, physical ids
scattered, and a fraction ``rho`` of the universe never used.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from .errors import PKVError, require
from .spec import MAX_SEQ_LEN, AttentionSpec, integer_array, is_integer
from .traces import (
    INT32_MAX, KV_SEED_OFFSET, PAGE_SEED_OFFSET, Q_SEED_OFFSET, Request, Step, TorchCompatibleRNG, check_seed,
)

MAX_HOLE_FRACTION = 0.95
#: Page ids are int32 (block tables, the kernels' page loads): at most 2**31 pages.
MAX_PAGES = INT32_MAX + 1
#: The largest page-id universe :func:`allocate` shuffles: its randperm is a Python loop, as
#: torch draws it, ~1 s and ~75 MB of host memory per million pages, so 2**25 pages take ~35 s
#: and ~2.5 GB. (2**25 pages of one token are 128 GiB of K and V at the published shape, an
#: H200's memory.) A larger request is refused before the loop starts.
MAX_ALLOCATION_PAGES = 2**25


def _check_spec(spec: object) -> AttentionSpec:
    require(isinstance(spec, AttentionSpec), f"spec must be an AttentionSpec, got {type(spec).__name__}")
    return spec


def check_hole_fraction(rho: object) -> float:
    if isinstance(rho, bool) or not isinstance(rho, (int, float, np.floating, np.integer)):
        raise PKVError(f"hole_fraction must be a number, got {rho!r}")
    require(0.0 <= float(rho) <= MAX_HOLE_FRACTION,
            f"hole_fraction={rho} is out of range [0, {MAX_HOLE_FRACTION}]")
    return float(rho)


@dataclass(frozen=True)
class PageAllocation:
    """Physical page ids per request, in logical order, drawn from a universe of ``num_pages``."""

    page_size: int
    hole_fraction: float
    num_pages: int
    pages: dict[int, np.ndarray]

    def table(self, request_ids, lengths) -> tuple[np.ndarray, np.ndarray]:
        """CSR block table (indptr [B+1], indices [nnz], int32) covering each row's real length.

        request_ids: [B] ids this allocation reserved pages for; lengths: int [B], each in
        [1, MAX_SEQ_LEN] tokens.
        """
        ids = integer_array("request_ids", request_ids, 0, INT32_MAX).tolist()
        lengths = integer_array("lengths", lengths, 1, MAX_SEQ_LEN)
        require(len(ids) == lengths.size, f"{len(ids)} request ids but {lengths.size} lengths")
        counts = (-(-lengths.astype(np.int64) // self.page_size)).tolist()
        indptr = np.zeros(len(counts) + 1, dtype=np.int64)
        indptr[1:] = np.cumsum(counts)
        require(int(indptr[-1]) <= INT32_MAX, f"the rows need {int(indptr[-1])} pages, more than int32 block "
                                              f"tables index ({INT32_MAX})")
        indptr = indptr.astype(np.int32)
        parts = []
        for rid, count in zip(ids, counts):
            owned = self.pages.get(rid)
            require(owned is not None, f"request {rid} has no pages in this allocation")
            require(count <= owned.size, f"request {rid} needs {count} pages but reserved {owned.size}")
            parts.append(owned[:count])
        indices = np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)
        return indptr, indices


def allocate(requests, page_size: int, hole_fraction: float, seed: int) -> PageAllocation:
    """Reserve pages for ``requests`` (each needs ``prompt + decode`` tokens) as the paper does."""
    rho = check_hole_fraction(hole_fraction)
    require(is_integer(page_size) and page_size >= 1, f"page_size must be an integer >= 1, got {page_size!r}")
    seed = check_seed(seed)
    require(isinstance(requests, (tuple, list)) and all(isinstance(r, Request) for r in requests),
            f"requests must be a sequence of Request, got {type(requests).__name__}")
    repeated = [rid for rid, count in Counter(r.id for r in requests).items() if count > 1]
    require(not repeated, f"request ids must be distinct; {repeated[0] if repeated else ''} appears more than once")
    reserved = {r.id: -(-r.max_len // page_size) for r in sorted(requests, key=lambda r: r.id)}
    total = sum(reserved.values())
    universe = math.ceil(total / max(1e-6, 1.0 - rho))
    require(universe <= MAX_ALLOCATION_PAGES,
            f"the requests need a universe of {universe} pages ({total} reserved, hole fraction {rho}), "
            f"more than the {MAX_ALLOCATION_PAGES} the allocator shuffles; use shorter rows or larger pages")
    perm = TorchCompatibleRNG(seed + PAGE_SEED_OFFSET).randperm(universe).astype(np.int32)
    pages, cursor = {}, 0
    for rid, count in reserved.items():
        pages[rid] = perm[cursor:cursor + count]
        cursor += count
    return PageAllocation(int(page_size), rho, universe, pages)


@dataclass(frozen=True)
class Batch:
    """One decode step's rows on the paged cache (a CSR block table).

    Parameters
    ----------
    spec : AttentionSpec
        The attention shape the step is planned for.
    seq_lens : array_like of int, shape [B]
        Each row's real length N*_i (>= 1); stored as int32.
    kv_indptr : array_like of int, shape [B + 1]
        Row i's pages are ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``; stored as int32.
    kv_indices : array_like of int, shape [nnz]
        Physical page ids in each row's logical order, each below ``num_pages``; stored as int32.
    num_pages : int
        Size of the page-id universe: the first dimension of K and V.

    Integer dtypes only (a float page id is refused, never truncated), every value within int32
    and the rows' pages enough for their lengths; checked once, with NumPy, when built.
    """

    spec: AttentionSpec
    seq_lens: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    num_pages: int

    def __post_init__(self) -> None:
        # NumPy passes over the arrays, no Python loop over rows: a server builds one per step.
        # Integer dtypes only and int32 ranges, checked before the casts below, which would
        # otherwise truncate a float page id (0.9 -> 0) or wrap a large one (2**32 + 3 -> 3).
        _check_spec(self.spec)
        require(is_integer(self.num_pages) and 1 <= self.num_pages <= MAX_PAGES,
                f"num_pages must be an integer in [1, {MAX_PAGES}], got {self.num_pages!r}")
        seq = integer_array("seq_lens", self.seq_lens, 1, MAX_SEQ_LEN)
        require(seq.size >= 1, "a batch needs at least one row")
        P = self.spec.page_size
        indptr = integer_array("kv_indptr", self.kv_indptr, 0, INT32_MAX)
        require(indptr.shape == (seq.size + 1,) and indptr[0] == 0,
                f"kv_indptr must have shape [{seq.size + 1}] and start at 0")
        need = -(-seq.astype(np.int64) // P)
        have = np.diff(indptr.astype(np.int64))
        wrong = np.flatnonzero(have != need)
        require(wrong.size == 0, f"row {wrong[0] if wrong.size else 0} lists "
                                 f"{int(have[wrong[0]]) if wrong.size else 0} pages but its length "
                                 f"needs {int(need[wrong[0]]) if wrong.size else 0}")
        idx = integer_array("kv_indices (page ids)", self.kv_indices, 0, self.num_pages - 1)
        require(idx.size == int(indptr[-1]), "kv_indices length does not match kv_indptr[-1]")
        object.__setattr__(self, "num_pages", int(self.num_pages))
        object.__setattr__(self, "seq_lens", seq.astype(np.int32))
        object.__setattr__(self, "kv_indptr", indptr.astype(np.int32))
        object.__setattr__(self, "kv_indices", idx.astype(np.int32))

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.size)

    @property
    def max_len(self) -> int:
        return int(self.seq_lens.max())

    @property
    def total_tokens(self) -> int:
        return int(self.seq_lens.astype(np.int64).sum())

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the step must read at least once."""
        return self.total_tokens * self.spec.kv_bytes_per_token

    @property
    def last_page_len(self) -> np.ndarray:
        """int32 [B]: tokens used in each row's last page (FlashInfer's kv_last_page_len)."""
        return ((self.seq_lens - 1) % self.spec.page_size + 1).astype(np.int32)

    def padded_block_table(self, width: int | None = None, fill: int = 0) -> np.ndarray:
        """int32 [B, width]: the 2-D block table vLLM and XQA take (unused slots = ``fill``)."""
        counts = np.diff(self.kv_indptr)
        width = int(counts.max()) if width is None else width
        require(width >= int(counts.max()), f"block-table width {width} is too small")
        table = np.full((self.batch_size, width), fill, dtype=np.int32)
        for i in range(self.batch_size):
            table[i, :counts[i]] = self.kv_indices[self.kv_indptr[i]:self.kv_indptr[i + 1]]
        return table


def batch_for_step(spec: AttentionSpec, allocation: PageAllocation, step: Step) -> Batch:
    _check_spec(spec)
    require(isinstance(allocation, PageAllocation),
            f"allocation must be a PageAllocation, got {type(allocation).__name__}")
    require(isinstance(step, Step), f"step must be a Step, got {type(step).__name__}")
    require(allocation.page_size == spec.page_size,
            f"allocation page_size {allocation.page_size} != spec page_size {spec.page_size}")
    indptr, indices = allocation.table(step.request_ids, step.lengths)
    return Batch(spec, np.asarray(step.lengths), indptr, indices, allocation.num_pages)


def make_batch(spec: AttentionSpec, seq_lens, hole_fraction: float = 0.0, seed: int = 0) -> Batch:
    """A batch of fresh rows with the given lengths (each row reserves exactly its length).

    seq_lens: int [B], each in [1, MAX_SEQ_LEN]; a float length is refused, never truncated.
    """
    _check_spec(spec)
    seq_lens = integer_array("lengths", seq_lens, 1, MAX_SEQ_LEN).tolist()
    require(len(seq_lens) >= 1, "a batch needs at least one row")
    requests = tuple(Request(i, 0, n, 0) for i, n in enumerate(seq_lens))
    alloc = allocate(requests, spec.page_size, hole_fraction, seed)
    indptr, indices = alloc.table(range(len(seq_lens)), seq_lens)
    return Batch(spec, np.asarray(seq_lens, dtype=np.int32), indptr, indices, alloc.num_pages)


def numpy_dtype(dtype: str):
    require(dtype in ("float16", "float32", "float64"),
            f"dtype {dtype!r} has no NumPy equivalent (bfloat16 runs on the GPU only)")
    return np.dtype(dtype)


def _standard_normal(spec: AttentionSpec, shape: tuple[int, ...], seed: int, offset: int, count: int):
    """``count`` arrays of ``shape`` in the spec's NumPy dtype, standard-normal, seeded ``seed + offset``."""
    dtype = numpy_dtype(spec.dtype)
    require(is_integer(seed) and seed >= 0, f"seed must be a non-negative integer, got {seed!r}")
    rng = np.random.default_rng(int(seed) + offset)
    try:
        return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(count))
    except MemoryError:
        gib = count * math.prod(shape) * (8 + dtype.itemsize) / 2**30  # float64 draws, then the cast
        raise PKVError(f"{count} x {list(shape)} random {dtype} values need ~{gib:.3g} GiB of host memory, "
                       "more than this machine can allocate") from None


def random_cache(spec: AttentionSpec, num_pages: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V of standard-normal values (seeded ``seed + 7``).

    Returns (k, v), each [num_pages, page_size, Hkv, D] of the spec's dtype (float16, float32 or
    float64: NumPy has no bfloat16).
    """
    _check_spec(spec)
    require(is_integer(num_pages) and 1 <= num_pages <= MAX_PAGES,
            f"num_pages must be an integer in [1, {MAX_PAGES}], got {num_pages!r}")
    shape = (int(num_pages), spec.page_size, spec.num_kv_heads, spec.head_dim)
    return _standard_normal(spec, shape, seed, KV_SEED_OFFSET, 2)


def random_fp8_cache(spec: AttentionSpec, num_pages: int, seed: int, per_head: bool = False):
    """An FP8 cache of standard-normal values: those of :func:`random_cache` with the same seed
    (drawn in the query dtype, ``spec.dtype``), quantised to e4m3 codes.

    Parameters
    ----------
    spec : AttentionSpec
        With ``kv_dtype`` ``float8_e4m3``; ``dtype`` (the queries') float16, float32 or float64.
    num_pages, seed : int
        As :func:`random_cache`.
    per_head : bool
        Scales per KV head ([Hkv]) instead of one per tensor ([1]).

    Returns
    -------
    (k_codes, v_codes, k_scale, v_scale)
        uint8 [num_pages, P, Hkv, D] each, and float32 scales (fp8.fit_scale: each tensor's or
        head's largest magnitude maps to 448); code c of head h stands for value(c) x scale[h].
    """
    from . import fp8

    _check_spec(spec)
    require(spec.fp8_kv, f"random_fp8_cache makes an FP8 cache; this spec's cache is {spec.cache_dtype}")
    k, v = random_cache(AttentionSpec(**{**spec.to_dict(), "kv_dtype": None}), num_pages, seed)
    axis = 2 if per_head else None
    k_scale, v_scale = fp8.fit_scale(k, axis), fp8.fit_scale(v, axis)
    return fp8.quantize(k, k_scale, axis), fp8.quantize(v, v_scale, axis), k_scale, v_scale


def random_queries(spec: AttentionSpec, batch_size: int, seed: int) -> np.ndarray:
    """Queries of standard-normal values (seeded ``seed + 2026``): [B, Hq, D] of the spec's dtype."""
    _check_spec(spec)
    require(is_integer(batch_size) and batch_size >= 1, f"batch_size must be an integer >= 1, got {batch_size!r}")
    (q,) = _standard_normal(spec, (int(batch_size), spec.num_qo_heads, spec.head_dim), seed, Q_SEED_OFFSET, 1)
    return q


def compact_batch(batch: Batch, hole_fraction: float = 0.0, seed: int = 0) -> tuple[Batch, np.ndarray]:
    """The same step on a cache that holds only the pages it uses.

    Parameters
    ----------
    batch : Batch
        A step on its full page universe.
    hole_fraction : float
        rho in [0, MAX_HOLE_FRACTION]: the used pages are spread over a universe of
        ceil(n_used / (1 - rho)) ids, the holes placed by a generator seeded with ``seed``; with
        rho = 0 the universe is exactly the used pages, ids 0..n_used-1.
    seed : int

    Returns
    -------
    (Batch, numpy.ndarray)
        The batch on the compact universe, and the used page ids of ``batch``, int64 [n_used] in
        ascending order: page ``used[j]`` of the full cache is the j-th used page of the compact one.

    The used ids keep their relative physical order (the trace's scattering: a row's logically
    consecutive pages stay as far apart, in the same order), so rows stay scattered and
    interleaved exactly as on the real cache.
    """
    rho = check_hole_fraction(hole_fraction)
    used, inverse = np.unique(batch.kv_indices, return_inverse=True)
    n_used = int(used.size)
    universe = math.ceil(n_used / (1.0 - rho)) if rho > 0 else n_used
    if universe == n_used:
        slots = np.arange(n_used, dtype=np.int64)
    else:
        slots = np.sort(np.random.default_rng(seed).choice(universe, size=n_used, replace=False))
    indices = slots[inverse.reshape(-1)].astype(np.int32)
    return Batch(batch.spec, batch.seq_lens, batch.kv_indptr, indices, int(universe)), used.astype(np.int64)
