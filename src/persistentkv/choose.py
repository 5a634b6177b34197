"""Which module runs a pkv-workqueue step: 4 or 8 warps per CTA, and for an FP8 cache 2-4
resident 4-warp CTAs per SM, chosen per step.

The one place a step's kernel shape is chosen (besides the policy, which picks the backend): a
pure function of the step's row lengths and the modules' queues, with the H200 measurements that
set its thresholds. The planner (plan.py) then shapes the step for the chosen module.
"""

from __future__ import annotations

import functools

import numpy as np

from .errors import require
from .plan import TILE_TOKENS, balanced_chunk_tiles, num_tiles, queue_waves


def queue_imbalance(tiles, num_kv_heads: int, target_items: int, min_chunk_tiles: int = 1) -> float:
    """The balanced queue's longest item over the mean work of its ``W * target_items`` slots
    (W = queue_waves): 1.0 when every slot carries the same work, 1.25 when the longest item is a
    quarter longer than that mean. A one-item-per-CTA queue takes about as long as its longest
    item, so this is the factor the step's per-row chunking costs over a perfect spread."""
    return _chunk_and_imbalance(tiles, num_kv_heads, target_items, min_chunk_tiles)[1]


def _chunk_and_imbalance(tiles, num_kv_heads: int, target_items: int, min_chunk_tiles: int) -> tuple[int, float]:
    """The balanced queue's chunk (balanced_chunk_tiles) and its queue_imbalance, from one search."""
    B = len(tiles)
    total = int(tiles.sum()) if isinstance(tiles, np.ndarray) else sum(tiles)
    chunk = balanced_chunk_tiles(tiles, num_kv_heads, target_items, min_chunk_tiles)
    longest = min(chunk, int(max(tiles)))
    cap = queue_waves(B, num_kv_heads, target_items) * target_items
    return chunk, longest * cap / (num_kv_heads * total)


def _rows(seq_lens, what: str) -> np.ndarray:
    """The step's row lengths as a 1-D array (no copy when they already are one); at least one."""
    seq = seq_lens if isinstance(seq_lens, np.ndarray) and seq_lens.ndim == 1 else \
        np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    require(seq.size >= 1, f"{what} needs at least one row")
    return seq


def _tiles_key(seq: np.ndarray, lens: list | None = None):
    """The memo key of the rows' tile counts: a tuple up to 64 rows (plain Python over a few rows
    costs less than numpy's calls; ``lens``, seq.tolist() where the caller has it), else the bytes
    of the int64 counts. _tile_counts reads it back."""
    if seq.size <= 64:
        return tuple(-(-n // TILE_TOKENS) for n in (seq.tolist() if lens is None else lens))
    return num_tiles(seq).tobytes()


def _tile_counts(key):
    """The tile counts of a _tiles_key: a list, or an int64 array."""
    return np.frombuffer(key, dtype=np.int64) if isinstance(key, bytes) else list(key)


#: choose_warps: the 8-warp module (one 192 KB CTA per SM, 128-token stages, a queue of one item
#: per SM) unless its queue's imbalance exceeds the 4-warp queue's (two CTAs per SM, twice the
#: items, so shorter ones) by more than this factor. On the H200, time(8 warps) / time(4 warps)
#: follows ~0.97 x the imbalance ratio: 0.97-0.99 on equal rows (ratio 1.00-1.02), 0.969 at B=4
#: 6K-50K (1.032), 1.052 and 1.074 at B=8 5.7K-22K and 13K-19K (1.084, 1.098), 1.08 and 1.32 on
#: B8-bimodal and B8-ragged (1.20, 1.50) (benchmarks/NOTES.md, "What ships", the 4 or 8 warps row).
WARPS8_MAX_IMBALANCE = 1.05
#: More (row, kv head) groups than the 8-warp queue has slots and no row longer than this: 4 warps.
#: Each group is then one item and the 8-warp queue runs several waves of one CTA per SM, whose
#: every item pays its first stage's latency with nothing else on the SM, where two 4-warp CTAs
#: per SM overlap one's ramp with the other's stream. H200 (benchmarks/NOTES.md, "What ships", the
#: 4 or 8 warps row): 8-warp time / 4-warp time 1.125 at B=64 x 1K, 1.13 at B=32 x 1K, 1.06 at
#: B=64 x 2K, 1.02 at B=64 x 4K; one wave (B=16 x 2K, 128 groups) 0.97: 8 warps stay there.
WARPS4_MULTIWAVE_MAX_TOKENS = 4096


def choose_warps(seq_lens, head_dim: int, *, num_kv_heads: int = 8, queue4: tuple[int, int] = (264, 2),
                 queue8: tuple[int, int] = (132, 4), max_imbalance: float = WARPS8_MAX_IMBALANCE) -> int:
    """4 or 8 warps for a pkv-workqueue step: 4 at head_dim > 128 (no 8-warp module); 8 for one
    row; 4 when the rows have more (row, kv head) groups than the 8-warp queue's ``queue8`` target
    and none is longer than WARPS4_MULTIWAVE_MAX_TOKENS; 8 for equal rows; otherwise 8 unless
    queue_imbalance with the 8-warp queue's (target_items, min_chunk_tiles) ``queue8`` exceeds
    ``max_imbalance`` x that of the 4-warp queue's ``queue4``.
    Worked numbers (Hkv = 8, H200 queues): B=1 -> 8 (any length); B=4 x 8K -> 8; B=16 x 2K (128
    groups) -> 8; B=64 x 1K-4K -> 4, B=64 x 8K -> 8; the zipf_b8 step
    (13184 ... 19392, 8 rows): 8 warps give every row 2 items, the longest 9696 tokens against a
    mean of 7707 (1.258), 4 warps 4416 against 3854 (1.146): ratio 1.098 -> 4; B=4 (50472, 6024,
    10088, 10424): 1.116 against 1.082, ratio 1.032 -> 8; head_dim 256 -> 4."""
    # Runs on every pkv-workqueue step's host path: one row and equal rows return before any
    # planning; ragged rows pay two chunk searches, remembered per tile counts (a decode step's
    # rows grow by a token, so its tiles change only when a row crosses a 32-token boundary).
    seq = _rows(seq_lens, "choose_warps")
    if head_dim > 128:
        return 4
    if seq.size == 1:
        return 8
    many_waves = seq.size * num_kv_heads > queue8[0]  # every group an item, more than the 8-warp slots
    lens = seq.tolist() if seq.size <= 64 else None  # plain Python over a few rows costs less than numpy's calls
    longest = max(lens) if lens is not None else int(seq.max())
    if many_waves and longest <= WARPS4_MULTIWAVE_MAX_TOKENS:
        return 4
    if longest == (min(lens) if lens is not None else int(seq.min())):
        return 8
    return _warps_for_tiles(_tiles_key(seq, lens), num_kv_heads, tuple(queue4), tuple(queue8), float(max_imbalance))


@functools.lru_cache(maxsize=1024)  # keys of up to 8 bytes a row: <= 4 MB at B = 512
def _warps_for_tiles(tiles, num_kv_heads: int, queue4: tuple, queue8: tuple, max_imbalance: float) -> int:
    """choose_warps's rule for ragged rows of ``tiles`` tiles: a tuple, or the bytes of an int64
    array (more than 64 rows); memoised."""
    counts = _tile_counts(tiles)
    imbalance4 = queue_imbalance(counts, num_kv_heads, *queue4)
    imbalance8 = queue_imbalance(counts, num_kv_heads, *queue8)
    return 4 if imbalance8 > max_imbalance * imbalance4 else 8


#: unsplit_min_chunk: the fewest (row, kv head) groups, and the longest row in tokens, of an 8-warp
#: step whose groups each get one item. The 8-warp queue (132 slots) splits 64 groups of 512 tokens
#: into two items each and merges them; one item a group skips the second item's ramp and the merge.
#: Fixed before its A/B (benchmarks/NOTES.md, FP8, "What is next (GPU)", item 3); measured on an
#: H100 at 01c48b3, auto with the rule / auto without it, paired over 15 rounds: 0.84-0.95 at 64
#: groups of 256 and 512 tokens (G=4 and 8, Hkv=8 and 1, fp16 and FP8, every round faster or 13-14
#: of 15), 0.99-1.01 at 768-2048 tokens (the controls, where it does not apply); at 4141a54 longer
#: rows or fewer groups lost unsplit (64 x 2048: 1.05x; 32 groups of 1024: 1.15x).
UNSPLIT_MIN_GROUPS = 64
UNSPLIT_MAX_TOKENS = 512


def unsplit_min_chunk(seq_lens, num_kv_heads: int) -> int | None:
    """The 8-warp queue's smallest item, in tiles, that gives each (row, kv head) group one item:
    the longest row's tiles, where the step has at least UNSPLIT_MIN_GROUPS groups and no row is
    longer than UNSPLIT_MAX_TOKENS; else None (the queue as it is). pkv-workqueue's auto applies it
    where choose_warps picks the 8-warp module (and on an FP8 cache choose_ctas_per_sm keeps it).
    Worked: 8 rows x 512 at Hkv=8 -> 16 (one item a group, not 2); 64 x 512 at Hkv=1 -> 16;
    8 x 256 at Hkv=8 -> 8; 8 x 513, 4 x 512 at Hkv=8 (32 groups), 64 x 2048 at Hkv=1 -> None."""
    # on every 8-warp step's host path: the group count first, which rules out most steps (few
    # rows) without reading the lengths
    seq = _rows(seq_lens, "unsplit_min_chunk")
    if seq.size * num_kv_heads < UNSPLIT_MIN_GROUPS:
        return None
    longest = int(seq.max())
    return None if longest > UNSPLIT_MAX_TOKENS else max(1, -(-longest // TILE_TOKENS))


#: choose_ctas_per_sm: the smallest mean item, in tokens, of a queue of ``ctas`` 4-warp FP8 CTAs per
#: SM (3 or 4). More resident CTAs hide the FP8 loop's conversion and mma latencies, but split the
#: rows into more, shorter items, each paying its ramp and its share of the merge. H200 A/B at
#: be4ba01 (benchmarks/NOTES.md, FP8, "Variants"), time / the shipped module's: 3 CTAs 0.963 at
#: B=1 x 128K and B=4 x 32K (2648 tokens an item), 0.972 on B8-bimodal (~2600), 1.007 at
#: B=1 x 32K (662), 1.09 at B=1 x 4K (83), 1.11-1.17 under Hkv=1 (83-331); 4 CTAs 0.953 at
#: B=64 x 8K (7944), 1.021 at B=1 x 128K (1986), 1.007 at B=4 x 32K, 1.012 on B8-bimodal.
#: A queue that keeps every (row, kv head) group one item has no such floor: nothing is split, so
#: no item pays a ramp or a merge (H200 at 3748346, 4 CTAs / the floored rule's module, paired:
#: 0.795 at B=64 x 16, 0.849 at B=64 x 64, 0.898 at 256, 0.942 at 1K, 0.948 at 4K; NOTES, "The
#: loop's variants and the CTA rule without an item floor").
CTAS_MIN_ITEM_TOKENS = {3: 2048, 4: 4096}
#: ... and its queue's imbalance (queue_imbalance) at most this factor over the module choose_warps
#: picked: 3 CTAs at B=64 x 8K leave 512 one-item groups over 396 slots (1.55 against 1.03; 1.134x
#: slower measured). 3 CTAs may balance up to 1.07 x worse: B8-bimodal's 3-CTA queue, 1.066 x the
#: 4-warp queue's, ran 0.973 x its time (3748346; 0.966 at a66ff0e).
CTAS_MAX_IMBALANCE = {3: 1.07, 4: 1.02}
#: ... and where choose_warps picked the 8-warp module and neither count passes those rules, the
#: first of CTAS_RAGGED_ORDER whose queue's imbalance is at most this fraction of the 8-warp queue's,
#: whatever its mean item: a ragged step of many groups, whose one item per SM leaves SMs idle
#: behind the longest items. Fixed before its A/B (benchmarks/NOTES.md, FP8, "What is next (GPU)",
#: item 2c) and measured on an H100 at 858cd35 over the first 10 of the 26 steps it moves among 200
#: seeded ragged steps, the rule's module / auto's (the 8-warp module), 15 rounds: B=32 to 4 CTAs
#: 0.681-0.847, B=64 to 3 CTAs 0.792-0.979, every round faster in each. A looser form (the ratio
#: without the 8-warp condition) lost where it moved 3 CTAs to 4 (1.060; NOTES, tried and rejected).
CTAS_RAGGED_MAX_IMBALANCE = 0.5
#: ... tried in this order: 3 CTAs before 4, though 4 balance the queue better. Fixed before its A/B
#: (NOTES, FP8, item 2d) and measured on an H100 at f5f2572 over the first 10 seeded ragged steps
#: among seeds 400-799 that it moves from 4 CTAs to 3 (all B=32), 15 rounds, 3 CTAs / 4: 0.929-0.979
#: per step's median, every round faster in each. Longer items pay fewer ramps.
CTAS_RAGGED_ORDER = (3, 4)


def choose_ctas_per_sm(seq_lens, num_kv_heads: int, num_sms: int, queue: tuple[int, int],
                       candidates=(4, 3), min_chunk_tiles: int = 2, *, picked_warps: int = 4) -> int | None:
    """More resident 4-warp CTAs per SM for an FP8 pkv-workqueue step, or None to keep the module
    choose_warps picked (whose balanced queue is ``queue``, (target_items, min_chunk_tiles)).

    The first of ``candidates`` (3 or 4 CTAs per SM, a queue of ``ctas * num_sms`` items of at
    least ``min_chunk_tiles`` tiles) whose mean item is at least CTAS_MIN_ITEM_TOKENS[ctas] tokens,
    or whose queue keeps every (row, kv head) group one item, and whose imbalance is at most
    CTAS_MAX_IMBALANCE[ctas] x the picked queue's. Where none is and ``picked_warps`` is 8 (the
    module choose_warps picked), the first of CTAS_RAGGED_ORDER among ``candidates`` whose
    imbalance is at most CTAS_RAGGED_MAX_IMBALANCE x the 8-warp queue's, its mean item whatever it
    is.
    Worked numbers (Hkv = 8, 132 SMs): B=64 x 8K -> 4 (528 items of 7944 tokens, imbalance 1.03 as
    the 8-warp queue's); B=64 x 16 to 4K -> 4 (512 one-item groups in 528 slots); B=1 x 128K and
    B=4 x 32K -> 3 (396 items of 2648 tokens; 4 CTAs: 1986); B=16 x 8K -> 3; B8-bimodal -> 3
    (1.066 x the 4-warp queue's imbalance); B=1 x 32K -> None (662 tokens at 3 CTAs); a ragged
    B=32 of 234-15069 tokens on the 8-warp module (imbalance 3.66) -> 3 (1.57; 4 CTAs: 1.30), its
    mean item under 2048 tokens."""
    # On every FP8 step's host path, as choose_warps: the answer is remembered per tile counts (the
    # two chunk searches cost 20-90 us; a decode step's tiles change only at 32-token boundaries).
    key = _tiles_key(_rows(seq_lens, "choose_ctas_per_sm"))
    return _ctas_for_tiles(key, int(num_kv_heads), int(num_sms), tuple(queue), tuple(candidates), int(min_chunk_tiles),
                           int(picked_warps) == 8)


@functools.lru_cache(maxsize=1024)
def _ctas_for_tiles(tiles, num_kv_heads: int, num_sms: int, queue: tuple, candidates: tuple,
                    min_chunk_tiles: int, from_8_warps: bool = False) -> int | None:
    """choose_ctas_per_sm's rule for rows of ``tiles`` tiles (a tuple, or the bytes of an int64
    array of more than 64 rows); memoised."""
    counts = _tile_counts(tiles)
    rows, longest = len(counts), int(max(counts) if isinstance(counts, list) else counts.max())
    group_tokens = TILE_TOKENS * num_kv_heads * int(sum(counts) if isinstance(counts, list) else counts.sum())
    base = None
    imbalances = {}
    for ctas in candidates:
        target = ctas * num_sms
        slots = queue_waves(rows, num_kv_heads, target) * target
        chunk, imbalances[ctas] = _chunk_and_imbalance(counts, num_kv_heads, target, min_chunk_tiles)
        if chunk < longest and group_tokens < CTAS_MIN_ITEM_TOKENS[ctas] * slots:
            continue  # groups split into items shorter than the floor (one-item groups have none)
        if base is None:
            base = queue_imbalance(counts, num_kv_heads, *queue)
        if imbalances[ctas] <= CTAS_MAX_IMBALANCE[ctas] * base:
            return ctas
    if not from_8_warps:
        return None
    if base is None:
        base = queue_imbalance(counts, num_kv_heads, *queue)
    return next((ctas for ctas in CTAS_RAGGED_ORDER
                 if ctas in imbalances and imbalances[ctas] <= CTAS_RAGGED_MAX_IMBALANCE * base), None)
