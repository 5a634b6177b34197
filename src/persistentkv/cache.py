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
from dataclasses import dataclass

import numpy as np

from .errors import PKVError, require
from .spec import AttentionSpec
from .traces import KV_SEED_OFFSET, PAGE_SEED_OFFSET, Q_SEED_OFFSET, Request, Step, TorchCompatibleRNG

MAX_HOLE_FRACTION = 0.95


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
        """CSR block table (indptr [B+1], indices [nnz], int32) covering each row's real length."""
        counts = [math.ceil(n / self.page_size) for n in lengths]
        indptr = np.zeros(len(counts) + 1, dtype=np.int32)
        indptr[1:] = np.cumsum(counts)
        parts = []
        for rid, count in zip(request_ids, counts):
            owned = self.pages[rid]
            require(count <= owned.size, f"request {rid} needs {count} pages but reserved {owned.size}")
            parts.append(owned[:count])
        indices = np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)
        return indptr, indices


def allocate(requests, page_size: int, hole_fraction: float, seed: int) -> PageAllocation:
    """Reserve pages for ``requests`` (each needs ``prompt + decode`` tokens) as the paper does."""
    rho = check_hole_fraction(hole_fraction)
    reserved = {r.id: math.ceil((r.prompt_len + r.decode_steps) / page_size)
                for r in sorted(requests, key=lambda r: r.id)}
    total = sum(reserved.values())
    universe = math.ceil(total / max(1e-6, 1.0 - rho))
    perm = TorchCompatibleRNG(seed + PAGE_SEED_OFFSET).randperm(universe).astype(np.int32)
    pages, cursor = {}, 0
    for rid, count in reserved.items():
        pages[rid] = perm[cursor:cursor + count]
        cursor += count
    return PageAllocation(page_size, rho, universe, pages)


@dataclass(frozen=True)
class Batch:
    """One decode step's rows on the paged cache.

    seq_lens:   int32 [B], each row's real length N*_i (>= 1)
    kv_indptr:  int32 [B + 1], row i's pages are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: int32 [nnz], physical page ids in logical order
    num_pages:  size of the page-id universe (first dimension of K and V)
    """

    spec: AttentionSpec
    seq_lens: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    num_pages: int

    def __post_init__(self) -> None:
        seq = np.asarray(self.seq_lens)
        require(seq.ndim == 1 and seq.size >= 1, "a batch needs at least one row")
        require(np.issubdtype(seq.dtype, np.integer), f"seq_lens must be integers, got {seq.dtype}")
        bad = np.flatnonzero(seq < 1)
        require(bad.size == 0, f"row {bad[0] if bad.size else 0} has length "
                               f"{int(seq[bad[0]]) if bad.size else 0}; lengths must be >= 1")
        require(int(seq.max()) < 2**31 - 1, "a row is longer than 2**31 - 1 tokens")
        P = self.spec.page_size
        indptr = np.asarray(self.kv_indptr)
        require(indptr.shape == (seq.size + 1,) and indptr[0] == 0,
                f"kv_indptr must have shape [{seq.size + 1}] and start at 0")
        need = -(-seq.astype(np.int64) // P)
        have = np.diff(indptr.astype(np.int64))
        wrong = np.flatnonzero(have != need)
        require(wrong.size == 0, f"row {wrong[0] if wrong.size else 0} lists "
                                 f"{int(have[wrong[0]]) if wrong.size else 0} pages but its length "
                                 f"needs {int(need[wrong[0]]) if wrong.size else 0}")
        idx = np.asarray(self.kv_indices)
        require(idx.size == int(indptr[-1]), "kv_indices length does not match kv_indptr[-1]")
        if idx.size:
            require(int(idx.min()) >= 0 and int(idx.max()) < self.num_pages,
                    f"page ids must lie in [0, {self.num_pages}), got [{int(idx.min())}, {int(idx.max())}]")
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
    require(allocation.page_size == spec.page_size,
            f"allocation page_size {allocation.page_size} != spec page_size {spec.page_size}")
    indptr, indices = allocation.table(step.request_ids, step.lengths)
    return Batch(spec, np.asarray(step.lengths, dtype=np.int32), indptr, indices, allocation.num_pages)


def make_batch(spec: AttentionSpec, seq_lens, hole_fraction: float = 0.0, seed: int = 0) -> Batch:
    """A batch of fresh rows with the given lengths (each row reserves exactly its length)."""
    raw = np.asarray(seq_lens).reshape(-1)
    require(raw.size >= 1, "a batch needs at least one row")
    # int() would truncate 3.7 to 3 silently; a non-integer length is a caller's mistake.
    require(np.issubdtype(raw.dtype, np.integer),
            f"lengths must be integers, got {raw.dtype} values such as {raw[0]!r}")
    seq_lens = [int(n) for n in raw]
    bad = [n for n in seq_lens if n < 1]
    require(not bad, f"length {bad[0] if bad else 0} is invalid; lengths must be >= 1")
    requests = tuple(Request(i, 0, n, 0) for i, n in enumerate(seq_lens))
    alloc = allocate(requests, spec.page_size, hole_fraction, seed)
    indptr, indices = alloc.table(range(len(seq_lens)), seq_lens)
    return Batch(spec, np.asarray(seq_lens, dtype=np.int32), indptr, indices, alloc.num_pages)


def numpy_dtype(dtype: str):
    require(dtype in ("float16", "float32", "float64"),
            f"dtype {dtype!r} has no NumPy equivalent (bfloat16 runs on the GPU only)")
    return np.dtype(dtype)


def random_cache(spec: AttentionSpec, num_pages: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V ``[num_pages, page_size, Hkv, D]`` of standard-normal values (seeded ``seed + 7``)."""
    rng = np.random.default_rng(seed + KV_SEED_OFFSET)
    shape = (num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    dtype = numpy_dtype(spec.dtype)
    return rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)


def random_queries(spec: AttentionSpec, batch_size: int, seed: int) -> np.ndarray:
    """Queries ``[B, Hq, D]`` of standard-normal values (seeded ``seed + 2026``)."""
    rng = np.random.default_rng(seed + Q_SEED_OFFSET)
    return rng.standard_normal((batch_size, spec.num_qo_heads, spec.head_dim)).astype(numpy_dtype(spec.dtype))


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
