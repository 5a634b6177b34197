"""Stress inputs for decode attention: the numerics that standard-normal inputs never reach.

``stress_case(kind, spec, lengths, seed) -> (batch, q, k, v)`` builds, on the host, a batch of
rows with ``lengths`` (scattered pages, a quarter of the page universe left as holes) and NumPy
q [B, Hq, D] and K, V [num_pages, P, Hkv, D] for one stress kind:

``large_scores``     Q and K scaled together so the scores q.k / sqrt(D) span SCORE_SPREAD (40)
                     natural units over the batch: exp() of the gap underflows float16.
``one_hot``          per row and kv head, one key aligned with the group's queries and large,
                     ONE_HOT_MARGIN (30) units above every other score: a one-hot softmax.
``equal_keys``       every key of a kv head equal: a uniform softmax, the output the mean of V.
``max_last_page``    the row's largest score only in its last page, MAX_MARGIN (12) units above
                     the rest: every earlier tile's state must be rescaled by exp(-12) or less.
``max_first_token``  the largest score at token 0, MAX_MARGIN above the rest: later tiles never
                     raise the running maximum.
``large_values``     V scaled so max |V| is LARGE_VALUE[dtype] (see there).
``zero_queries``     q = 0: every score 0, a uniform softmax.

Every kind returns float arrays holding values of the spec's dtype: float16, float32 and float64
as themselves, bfloat16 as float32 arrays of bfloat16-rounded values (NumPy has no bfloat16;
``torch.from_numpy(a).to(torch.bfloat16)`` is exact on them). The reference is
``reference_decode`` (float64) on exactly these values, so rounding the inputs is not an error.
The GPU tests move the arrays to the device; the CPU tests run them as they are.
"""

from __future__ import annotations

import math

import numpy as np

from persistentkv.cache import Batch, make_batch
from persistentkv.reference import TOLERANCE, default_scale  # noqa: F401 (TOLERANCE: the tests' one table)
from persistentkv.spec import AttentionSpec

KINDS = ("large_scores", "one_hot", "equal_keys", "max_last_page", "max_first_token", "large_values",
         "zero_queries")
SCORE_SPREAD = 40.0
ONE_HOT_MARGIN = 30.0
MAX_MARGIN = 12.0
#: Largest |V| of ``large_values``. float16: 2**14, a quarter of its largest finite value (65504):
#: the output (a convex combination of V) and a kernel's float32 sums of P @ V (at most 2**14 per
#: token: 2**30 for a 64K-token split) stay finite, while an unnormalised float16 sum overflows
#: once four tokens weigh ~1. bfloat16 and float32 share float32's exponent: 2**100 leaves 2**28
#: of headroom below float32's 2**128 for the sums, and overflows any step done in float16.
LARGE_VALUE = {"float16": 2.0**14, "bfloat16": 2.0**100, "float32": 2.0**100, "float64": 2.0**100}
#: A quarter of the page universe holds no row (holes), filled like the rest.
HOLE_FRACTION = 0.25


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` rounded to ``dtype`` (to nearest, ties to even), as a NumPy float array."""
    if dtype == "bfloat16":
        bits = np.asarray(values, np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000   # round the low 16 bits away
        return bits.astype(np.uint32).view(np.float32)
    return np.asarray(values).astype(dtype)


def row_tokens(batch: Batch, row: int) -> tuple[np.ndarray, np.ndarray]:
    """(page id, slot in the page) of each token of ``row``, int64 [N_row] each, in logical order."""
    P = batch.spec.page_size
    t = np.arange(int(batch.seq_lens[row]))
    pages = batch.kv_indices[int(batch.kv_indptr[row]) + t // P].astype(np.int64)
    return pages, t % P


def scores(batch: Batch, q: np.ndarray, k: np.ndarray, row: int, head: int) -> np.ndarray:
    """float64 [G, N_row]: q.k / sqrt(D) of kv head ``head``'s query heads over ``row``'s tokens."""
    G = batch.spec.group_size
    pages, slots = row_tokens(batch, row)
    keys = k[pages, slots, head].astype(np.float64)                        # [N, D]
    return q[row, head * G:(head + 1) * G].astype(np.float64) @ keys.T * default_scale(batch.spec.head_dim)


def _large_scores(batch, q, k, v, rng):
    spread = max(float(np.ptp(scores(batch, q, k, row, h))) for row in range(batch.batch_size)
                 for h in range(batch.spec.num_kv_heads))
    scale = math.sqrt(SCORE_SPREAD / spread) if spread > 0 else 1.0   # scores scale with its square
    q *= scale
    k *= scale


def _dominant(position, margin: float):
    """Per row and kv head: the group's queries share one direction u (plus noise); the key at
    ``position(n, P, rng)`` becomes alpha * u, alpha chosen so its score beats every other score
    of every query head of the group by ``margin``."""
    def build(batch, q, k, v, rng):
        spec = batch.spec
        G, D, P = spec.group_size, spec.head_dim, spec.page_size
        for row in range(batch.batch_size):
            pages, slots = row_tokens(batch, row)
            for h in range(spec.num_kv_heads):
                u = rng.standard_normal(D)
                u /= np.linalg.norm(u)
                q[row, h * G:(h + 1) * G] = math.sqrt(D) * u + 0.3 * rng.standard_normal((G, D))
                j = position(pages.size, P, rng)
                s = scores(batch, q, k, row, h)
                others = np.delete(s, j, axis=1).max(axis=1) if pages.size > 1 else np.zeros(G)
                along = q[row, h * G:(h + 1) * G] @ u * default_scale(D)   # score per unit of alpha
                k[pages[j], slots[j], h] = float(np.max((others + margin) / along)) * u
    return build


def _equal_keys(batch, q, k, v, rng):
    k[:] = rng.standard_normal((batch.spec.num_kv_heads, batch.spec.head_dim))   # broadcast over tokens


def _large_values(batch, q, k, v, rng):
    v *= LARGE_VALUE[batch.spec.dtype] / np.abs(v).max()


def _zero_queries(batch, q, k, v, rng):
    q[:] = 0.0


BUILDERS = {
    "large_scores": _large_scores,
    "one_hot": _dominant(lambda n, P, rng: int(rng.integers(n)), ONE_HOT_MARGIN),
    "equal_keys": _equal_keys,
    "max_last_page": _dominant(lambda n, P, rng: int(rng.integers((n - 1) // P * P, n)), MAX_MARGIN),
    "max_first_token": _dominant(lambda n, P, rng: 0, MAX_MARGIN),
    "large_values": _large_values,
    "zero_queries": _zero_queries,
}


def stress_case(kind: str, spec: AttentionSpec, lengths, seed: int):
    """(batch, q, k, v) of one stress kind (module docstring); NumPy arrays, the same for one seed.

    q: [B, Hq, D]; k, v: [batch.num_pages, P, Hkv, D]; values of ``spec.dtype`` (bfloat16 as
    float32 arrays of bfloat16 values).
    """
    if kind not in BUILDERS:
        raise ValueError(f"unknown stress kind {kind!r}; expected one of {', '.join(KINDS)}")
    batch = make_batch(spec, lengths, HOLE_FRACTION, seed)
    rng = np.random.default_rng(seed)
    shape = (batch.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    q = rng.standard_normal((batch.batch_size, spec.num_qo_heads, spec.head_dim))
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    BUILDERS[kind](batch, q, k, v, rng)
    return batch, round_to(q, spec.dtype), round_to(k, spec.dtype), round_to(v, spec.dtype)
