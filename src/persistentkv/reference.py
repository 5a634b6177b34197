"""The independent reference: dense float64 attention, and a NumPy executor for any plan.

``reference_decode`` never looks at a plan: it gathers each row's tokens through the block table
and runs plain softmax attention in float64. ``execute_plan`` runs a plan's work items one by one
(each a partial online-softmax state over its token range), then merges the partial states
exactly as the paper writes it, in its (o, lse) form:

    m = max_s lse_s,  w_s = exp(lse_s - m),  o = sum_s w_s o_s / sum_s w_s   (0 if all splits empty)

so the executor proves a plan right on any machine, and is the ``numpy`` backend.

An FP8 cache (spec.kv_dtype ``float8_e4m3``: uint8 e4m3 codes and float32 scales, per tensor or
per KV head) enters both as the values it stands for: :func:`dequantized_cache` gives float64 K
and V (``value(code) x scale`` exactly: a 4-bit significand times a float32 scale fits a float64),
which ``reference_decode`` takes as any float64 cache. The ``numpy`` backend dequantises in
float32 instead (one rounding of that exact product, as a float32 multiply on the GPU does) and
runs ``execute_plan`` on that; so the reference, which sees the exact values, judges the
executor's float32 dequantisation too.

The gate every correctness check uses: ``gate(out, ref, tol)`` judges each (row, query head)
alone, ||out[b, h] - ref[b, h]|| / ||ref[b, h]|| <= tol, with ``TOLERANCE[dtype]`` the one table
of tolerances. (One norm over the whole batch would let a long row, whose output norm is small,
be badly wrong and pass.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .cache import Batch
from .errors import PKVError, require
from .fp8 import dequantize, scale_reasons
from .plan import Plan, unpack_items


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _float_array(name: str, value) -> np.ndarray:
    require(isinstance(value, np.ndarray), f"{name} must be a NumPy array, got {type(value).__name__}")
    require(value.dtype.kind == "f", f"{name} must hold real floating-point values, got dtype {value.dtype}")
    return value


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return default_scale(head_dim)
    ok = isinstance(scale, (int, float, np.integer, np.floating)) and not isinstance(scale, bool)
    require(ok and math.isfinite(scale), f"scale must be a finite number, got {scale!r}")
    return float(scale)


def _check_inputs(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, batch: Batch) -> None:
    """q [B, Hq, D], K and V [>= num_pages, P, Hkv, D]: NumPy float arrays, K and V of one dtype."""
    require(isinstance(batch, Batch), f"batch must be a Batch, got {type(batch).__name__}")
    for name, value in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _float_array(name, value)
    require(k_cache.dtype == v_cache.dtype,
            f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}; K and V must share one dtype")
    spec = batch.spec
    require(q.shape == (batch.batch_size, spec.num_qo_heads, spec.head_dim),
            f"q has shape {q.shape}, expected {(batch.batch_size, spec.num_qo_heads, spec.head_dim)}")
    expected = (batch.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    require(k_cache.shape[1:] == expected[1:] and k_cache.shape[0] >= batch.num_pages,
            f"k_cache has shape {k_cache.shape}, expected {expected}")
    require(v_cache.shape == k_cache.shape, f"v_cache shape {v_cache.shape} != k_cache shape {k_cache.shape}")


def dequantized_cache(k_codes: np.ndarray, v_codes: np.ndarray, k_scale, v_scale,
                      dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """The values an FP8 cache stands for: (K, V) in ``dtype``, ``value(code) x scale[h]``.

    Parameters
    ----------
    k_codes, v_codes : numpy.ndarray
        uint8 e4m3 codes [num_pages, P, Hkv, D], one shape (a NumPy view of a
        torch.float8_e4m3fn cache: ``t.view(torch.uint8).numpy()``).
    k_scale, v_scale : float or numpy.ndarray
        One value, or float32 [1] or [Hkv] (one per KV head, axis 2 of the codes); finite, > 0.
    dtype : numpy dtype
        float64 (default: exact, what the reference takes) or float32 (one rounding of the exact
        product, as the GPU's float32 multiply; the NumPy executor's).

    Pass the result to :func:`reference_decode` (or :func:`execute_plan`) as ``k_cache, v_cache``.
    """
    for name, codes in (("k_codes", k_codes), ("v_codes", v_codes)):
        require(isinstance(codes, np.ndarray), f"{name} must be a NumPy array, got {type(codes).__name__}")
        require(codes.dtype == np.uint8, f"{name} must be uint8 e4m3 codes, got dtype {codes.dtype}")
        require(codes.ndim == 4, f"{name} must be [num_pages, P, Hkv, D], got shape {codes.shape}")
    require(k_codes.shape == v_codes.shape, f"v_codes shape {v_codes.shape} != k_codes shape {k_codes.shape}")
    hkv = k_codes.shape[2]
    reasons = scale_reasons("k_scale", k_scale, hkv) + scale_reasons("v_scale", v_scale, hkv)
    require(not reasons, "; ".join(reasons))
    return (dequantize(k_codes, k_scale, head_axis=2, dtype=dtype),
            dequantize(v_codes, v_scale, head_axis=2, dtype=dtype))


def gather_row(cache: np.ndarray, batch: Batch, row: int, tok_lo: int, tok_hi: int, head=None) -> np.ndarray:
    """Tokens [tok_lo, tok_hi) of ``row`` through the block table: [n, Hkv, D] (or [n, D] for one head)."""
    P = batch.spec.page_size
    base = int(batch.kv_indptr[row])
    first_page, last_page = tok_lo // P, -(-tok_hi // P)
    pages = batch.kv_indices[base + first_page: base + last_page]
    block = cache[pages] if head is None else cache[pages, :, head, :]
    block = block.reshape((-1,) + block.shape[2:])
    offset = tok_lo - first_page * P
    return block[offset: offset + (tok_hi - tok_lo)]


def reference_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, batch: Batch,
                     scale: float | None = None) -> np.ndarray:
    """Dense float64 decode attention, never looking at a plan.

    Parameters
    ----------
    q : numpy.ndarray
        [B, Hq, D], any float dtype.
    k_cache, v_cache : numpy.ndarray
        [num_pages (or more), P, Hkv, D], one float dtype for both (an FP8 cache: the float64
        values of :func:`dequantized_cache`).
    batch : Batch
        The rows and their block table.
    scale : float, optional
        Softmax scale (default 1 / sqrt(D)); finite.

    Returns
    -------
    numpy.ndarray
        out, [B, Hq, D] float64.
    """
    _check_inputs(q, k_cache, v_cache, batch)
    spec = batch.spec
    scale = _check_scale(scale, spec.head_dim)
    G = spec.group_size
    out = np.empty((batch.batch_size, spec.num_qo_heads, spec.head_dim), dtype=np.float64)
    for row in range(batch.batch_size):
        n = int(batch.seq_lens[row])
        k = gather_row(k_cache, batch, row, 0, n).astype(np.float64)   # [n, Hkv, D]
        v = gather_row(v_cache, batch, row, 0, n).astype(np.float64)
        qh = q[row].astype(np.float64).reshape(spec.num_kv_heads, G, spec.head_dim)
        s = np.einsum("hgd,nhd->hgn", qh, k) * scale
        s -= s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        out[row] = np.einsum("hgn,nhd->hgd", p, v).reshape(spec.num_qo_heads, spec.head_dim)
    return out


def partial_state(q_group: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                  accum=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """(o [G, D], lse [G]) over the tokens of ``k``/``v`` ([n, D]); the neutral state when n == 0."""
    G, D = q_group.shape
    if k.shape[0] == 0:
        return np.zeros((G, D), accum), np.full(G, -np.inf, accum)
    s = (q_group.astype(accum) @ k.astype(accum).T) * accum(scale)
    m = s.max(axis=1)
    p = np.exp(s - m[:, None])
    l = p.sum(axis=1)
    o = (p @ v.astype(accum)) / l[:, None]
    return o, m + np.log(l)


def merge_states(o: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """Merge partial states o [S, G, D], lse [S, G] into [G, D]; all-empty -> 0."""
    m = lse.max(axis=0)
    finite = np.isfinite(m)
    w = np.where(finite[None, :], np.exp(lse - np.where(finite, m, 0)[None, :]), 0.0)
    denom = w.sum(axis=0)
    num = (w[:, :, None] * o).sum(axis=0)
    return np.where(denom[:, None] > 0, num / np.where(denom > 0, denom, 1)[:, None], 0.0)


def execute_plan(plan: Plan, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, batch: Batch,
                 out: np.ndarray | None = None, scale: float | None = None) -> np.ndarray:
    """Run ``plan``'s items and merges on the CPU.

    Accumulates in float64 when the cache is float64, else in float32 (as the GPU kernels do).
    Padded items are clipped to N_i.

    Parameters
    ----------
    plan : Plan
        Made for ``batch`` (same lengths and kv heads).
    q : numpy.ndarray
        [B, Hq, D], the cache's dtype.
    k_cache, v_cache : numpy.ndarray
        [num_pages (or more), P, Hkv, D], float16, float32 or float64, one dtype for both.
    batch : Batch
        The rows and their block table.
    out : numpy.ndarray, optional
        [B, Hq, D] of the cache's dtype, writeable; every element is written.
    scale : float, optional
        Softmax scale (default 1 / sqrt(D)); finite.

    Returns
    -------
    numpy.ndarray
        ``out`` (a new [B, Hq, D] array of the cache's dtype when none is given).
    """
    _check_inputs(q, k_cache, v_cache, batch)
    require(isinstance(plan, Plan), f"plan must be a Plan (plan.make_plan), got {type(plan).__name__}")
    require(plan.batch_size == batch.batch_size and np.array_equal(plan.seq_lens, batch.seq_lens)
            and plan.spec.num_kv_heads == batch.spec.num_kv_heads, "the plan was made for a different batch")
    require(q.dtype == k_cache.dtype, f"q is {q.dtype} but the cache is {k_cache.dtype}; they must match")
    spec = batch.spec
    scale = _check_scale(scale, spec.head_dim)
    accum = np.float64 if k_cache.dtype == np.float64 else np.float32
    G, D = spec.group_size, spec.head_dim
    if out is None:
        out = np.empty((batch.batch_size, spec.num_qo_heads, D), dtype=k_cache.dtype)
    # the checks a NumPy write would do with a raw error, or not at all: an integer out truncates
    # the result, a float16 out of a float32 cache loses its precision silently
    _float_array("out", out)
    require(out.shape == q.shape, f"out has shape {out.shape}, expected {q.shape}")
    require(out.dtype == k_cache.dtype, f"out is {out.dtype} but the cache is {k_cache.dtype}; they must match")
    require(out.flags.writeable, "out is read-only")
    cols = unpack_items(plan.items)
    n = plan.num_items
    part_o = np.zeros((n, G, D), accum)
    part_lse = np.full((n, G), -np.inf, accum)
    for i in range(n):
        row, head = int(cols["row"][i]), int(cols["head"][i])
        lo = int(cols["tok_lo"][i])
        hi = min(int(cols["tok_hi"][i]), int(batch.seq_lens[row]))
        heads = slice(head * G, (head + 1) * G)
        k = gather_row(k_cache, batch, row, lo, max(lo, hi), head)
        v = gather_row(v_cache, batch, row, lo, max(lo, hi), head)
        o, lse = partial_state(q[row, heads], k, v, scale, accum)
        if cols["num_splits"][i] == 1:
            out[row, heads] = o
        else:
            part_o[i], part_lse[i] = o, lse
    for row, head, first, count in plan.merge_groups.tolist():
        out[row, head * G:(head + 1) * G] = merge_states(part_o[first:first + count],
                                                         part_lse[first:first + count])
    return out


def _real_float64(name: str, value) -> np.ndarray:
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):  # ragged nested lists
        raise PKVError(f"{name} must be an array of numbers, got a ragged {type(value).__name__}") from None
    require(array.dtype.kind in "fiu", f"{name} must hold real numbers, got dtype {array.dtype}")
    return array.astype(np.float64)


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref|| over the whole array, in float64; NaN or inf in ``out`` gives inf.

    ``out`` and ``ref`` are real arrays of one shape (no broadcasting); ``ref`` must be finite.
    One norm over a batch lets a long row (small output norm) be badly wrong and pass: no gate
    uses it (they judge per (row, head): ``gate``); it stays a column of the validation tables.
    """
    out64, ref64 = _real_float64("out", out), _real_float64("ref", ref)
    require(out64.shape == ref64.shape, f"out has shape {out64.shape} but ref has {ref64.shape}; they must match")
    require(bool(np.isfinite(ref64).all()), "ref holds NaN or inf; a reference must be finite")
    if not np.all(np.isfinite(out64)):
        return math.inf
    return float(np.linalg.norm(out64 - ref64) / max(np.linalg.norm(ref64), 1e-300))


#: Error against float64 each cache dtype must meet, per (row, query head): the one table the
#: code's defaults, the tests and the renderers read (config validation.* rtol keys override it
#: for the commands).
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5, "float64": 1e-12}
#: The floor of a (row, head)'s reference norm: a zero reference judges ||out|| / TINY_NORM, so a
#: zero output there has error 0 and any other output a huge one.
TINY_NORM = 1e-300


def tolerance(dtype_or_tol) -> float:
    """TOLERANCE[name] for a dtype name, else the number itself (a positive finite float)."""
    if isinstance(dtype_or_tol, str):
        require(dtype_or_tol in TOLERANCE, f"no tolerance for dtype {dtype_or_tol!r}; known: {', '.join(TOLERANCE)}")
        return TOLERANCE[dtype_or_tol]
    ok = isinstance(dtype_or_tol, (int, float, np.integer, np.floating)) and not isinstance(dtype_or_tol, bool)
    require(ok and math.isfinite(dtype_or_tol) and dtype_or_tol > 0,
            f"a tolerance must be a dtype name or a positive finite number, got {dtype_or_tol!r}")
    return float(dtype_or_tol)


def row_head_errors(out, ref) -> np.ndarray:
    """float64 [B, Hq]: ||out[b, h, :] - ref[b, h, :]|| / max(||ref[b, h, :]||, TINY_NORM).

    ``out`` and ``ref`` are real arrays [B, Hq, D] of one shape (anything ``np.asarray`` takes);
    ``ref`` must be finite. A (row, head) where ``out`` holds NaN or inf has error inf; one whose
    reference is zero has error 0 when ``out`` is zero there too, else ~||out|| / 1e-300 (fails).
    """
    out64, ref64 = _real_float64("out", out), _real_float64("ref", ref)
    require(out64.shape == ref64.shape, f"out has shape {out64.shape} but ref has {ref64.shape}; they must match")
    require(out64.ndim == 3, f"out and ref must be [B, Hq, D], got shape {out64.shape}")
    require(bool(np.isfinite(ref64).all()), "ref holds NaN or inf; a reference must be finite")
    finite = np.isfinite(out64).all(axis=-1)
    diff = np.linalg.norm(np.where(np.isfinite(out64), out64, 0.0) - ref64, axis=-1)
    err = diff / np.maximum(np.linalg.norm(ref64, axis=-1), TINY_NORM)
    return np.where(finite, err, math.inf)


@dataclass(frozen=True)
class RowGate:
    """The per-(row, query head) verdict of an output against float64 (``gate``).

    ``max_err`` is the worst (row, head) error, at ``worst_row``/``worst_head`` (-1 for an empty
    batch); ``failing`` counts the (row, head) over ``tol`` out of ``total``; ``worst_tokens`` is the
    worst row's length where the caller gave the lengths (else None)."""

    max_err: float
    worst_row: int
    worst_head: int
    failing: int
    total: int
    tol: float
    worst_tokens: int | None = None

    @property
    def passed(self) -> bool:
        return self.failing == 0

    def describe(self) -> str:
        """One line: 'row 17 head 3 (8994 tokens): rel err 4.1e-02 > 1e-02; 12 of 8192 (row, head) over'."""
        if self.total == 0:
            return f"no (row, head) to judge (tolerance {self.tol:.0e})"
        tokens = f" ({self.worst_tokens} tokens)" if self.worst_tokens is not None else ""
        sign = ">" if self.max_err > self.tol else "<="
        return (f"row {self.worst_row} head {self.worst_head}{tokens}: rel err {self.max_err:.1e} {sign} "
                f"{self.tol:.0e}; {self.failing} of {self.total} (row, head) over")


def gate_errors(errors, tol, seq_lens=None) -> RowGate:
    """The RowGate of per-(row, head) errors [B, Hq] (``row_head_errors``) against ``tol`` (a
    number or a dtype name of TOLERANCE); ``seq_lens`` [B], optional, names the worst row's length."""
    errors = np.asarray(errors, dtype=np.float64)
    require(errors.ndim == 2, f"errors must be [B, Hq], got shape {errors.shape}")
    tol = tolerance(tol)
    errors = np.where(np.isnan(errors), math.inf, errors)
    if errors.size == 0:
        return RowGate(0.0, -1, -1, 0, 0, tol)
    row, head = np.unravel_index(int(np.argmax(errors)), errors.shape)
    tokens = None if seq_lens is None else int(np.asarray(seq_lens)[row])
    return RowGate(float(errors[row, head]), int(row), int(head), int((errors > tol).sum()), int(errors.size), tol,
                   tokens)


def gate(out, ref, tol, seq_lens=None) -> RowGate:
    """``out`` [B, Hq, D] against the float64 ``ref`` per (row, query head): row_head_errors,
    judged by gate_errors (passed: every (row, head) within ``tol``)."""
    return gate_errors(row_head_errors(out, ref), tol, seq_lens)
