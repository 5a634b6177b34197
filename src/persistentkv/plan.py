"""The scheduler: split counts from real lengths, row-local split bounds, buckets, the work queue.

Pure and CPU-testable; the GPU planner (pkv_plan in kernels/pkv_decode.cu) produces the same items for the
work-queue route, and a test holds the two equal.

Vocabulary (the paper's):

* A row ``i`` has real length ``N_i`` and ``T_i = ceil(N_i / TILE_TOKENS)`` tiles.
* With ``S_i`` splits, split ``s`` covers tiles ``floor(T_i*s/S_i) .. floor(T_i*(s+1)/S_i)`` (the
  *row-local bound*); its token range is clipped to ``N_i``. Splits of one row partition
  ``[0, N_i)`` exactly; a split is empty only when ``S_i > T_i``.
* A *work item* is one (row, kv head, split); one CTA runs it and loads each K/V byte of its
  range once for all G query heads. Items of one (row, kv head) are contiguous in split order, so
  an item's partial (merge) state lives at slot ``item index`` and its group starts at
  ``index - split``.
* Routes (names.PLAN_ROUTES): ``split`` (the rectangular B x Hkv x S grid, empty splits
  included), ``buckets`` (rows grouped by exact length, one decode + merge launch pair per
  bucket), ``padded_buckets`` (rows grouped by length rounded up to a bucket size; ablation only),
  ``workqueue`` (only non-empty items, split counts balanced across rows, one launch with the
  merge fused in).

Item encoding, int32 ``[n, 4]``: ``(row | kv_head << 16, tok_lo, tok_hi, split | num_splits << 16)``.
Which module runs a step (4 or 8 warps) is chosen per step in persistentkv.choose.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np

from .cache import Batch
from .errors import PKVError, require
from .names import PLAN_ROUTES
from .spec import AttentionSpec, is_integer

#: Tokens per planning tile: split bounds fall on multiples of this (the paper's 32).
TILE_TOKENS = 32
#: Bytes of one partial state per query head as our kernels store it: o (D floats) + lse.
PARTIAL_FLOATS_EXTRA = 1
#: The paper's count per query head: acc (D floats) + m + l.
PAPER_PARTIAL_FLOATS_EXTRA = 2
MAX_BATCH = 65535  # row index is packed into 16 bits
#: split counts and kv heads sit in the high 16 bits of an int32 word; 15 bits keep it non-negative
#: (at 2**15 the word wraps negative and ``>> 16`` reads a negative count).
MAX_SPLITS = 2**15 - 1
MAX_KV_HEADS = 2**15 - 1


def num_tiles(seq_lens: np.ndarray) -> np.ndarray:
    return (np.asarray(seq_lens, dtype=np.int64) + TILE_TOKENS - 1) // TILE_TOKENS


def split_tile_bounds(tiles: int, splits: int, split: int) -> tuple[int, int]:
    """Row-local bound: split ``split`` of ``splits`` covers tiles [lo, hi) of ``tiles``."""
    return (tiles * split) // splits, (tiles * (split + 1)) // splits


def queue_waves(batch_size: int, num_kv_heads: int, target_items: int) -> int:
    """Waves of ``target_items`` the balanced queue may fill: one, unless the step has so many
    (row, kv head) pairs that even one item each would not fit (then as few as hold them all)."""
    require(is_integer(target_items) and target_items >= 1, f"target_items must be an integer >= 1, got {target_items!r}")
    return (batch_size * num_kv_heads) // target_items + 1


def _queue_items(tiles, chunk: int) -> int:
    """sum_i ceil(T_i / chunk) for a NumPy array or a plain list of tile counts."""
    if isinstance(tiles, np.ndarray):
        return int(((tiles + (chunk - 1)) // chunk).sum())
    return sum(-(-t // chunk) for t in tiles)


def balanced_chunk_tiles(tiles, num_kv_heads: int, target_items: int, min_chunk_tiles: int = 1) -> int:
    """Tiles per work item for rows of ``tiles`` tiles: the queue must fit in whole waves.

    With W = queue_waves(B, Hkv, target) and cap = W * target, any chunk c with
    Hkv * sum_i ceil(T_i / c) <= cap fits. The closed form c = ceil(Hkv * sum_i T_i / (cap - B * Hkv))
    always does: Hkv * sum_i ceil(T_i / c) <= Hkv * (sum_i T_i / c + B) <= cap (every row's ceil()
    paid up front). The smallest chunk (>= ``min_chunk_tiles``) that fits is found by bisection
    between ceil(Hkv * sum T / cap), below which nothing fits, and the closed form: the same split
    counts on uniform rows, but ragged rows fill the wave with shorter items instead of leaving
    slots empty (the closed form itself, v2-v6, lost: benchmarks/NOTES.md, v7).

    Worked numbers (Hkv=8, target 264 = 2 CTAs x 132 SMs): B=1 at 4096 tokens (128 tiles): 4 tiles
    (128 tokens), 32 splits, 256 items. B=4 x 32768 (1024 tiles each): the closed form
    is ceil(8 * 4096 / 232) = 142 and the smallest fit is 128 (8 * 4 * ceil(1024 / 128) = 256 <= 264),
    S_i = 8 either way. The B=8 lengths (49152, 4096, 8192, 6144, 40960, 8192, 6144, 7168): closed
    form 163 tiles (232 items, the longest 5120 tokens), smallest fit 128 (264 items, at most 4096).
    """
    require(is_integer(min_chunk_tiles) and min_chunk_tiles >= 1,
            f"min_chunk_tiles must be an integer >= 1, got {min_chunk_tiles!r}")
    batch_size = len(tiles)
    total = int(tiles.sum()) if isinstance(tiles, np.ndarray) else sum(tiles)
    cap = queue_waves(batch_size, num_kv_heads, target_items) * target_items
    room = cap - batch_size * num_kv_heads
    hi = max(min_chunk_tiles, -(-(num_kv_heads * total) // room))
    lo = max(min_chunk_tiles, -(-(num_kv_heads * total) // cap))
    while lo < hi:  # invariant: hi fits; every chunk below lo does not (or is below the minimum)
        mid = (lo + hi) // 2
        if num_kv_heads * _queue_items(tiles, mid) <= cap:
            hi = mid
        else:
            lo = mid + 1
    return hi


def balanced_row_splits(seq_lens: np.ndarray, num_kv_heads: int, target_items: int,
                        min_chunk_tiles: int = 1) -> np.ndarray:
    """Split count per row: ceil(T_i / chunk) with one chunk size for the whole step.

    Long rows get many splits and short rows few, so items carry about equal work, and the item
    count stays within ``max_workqueue_items`` (whole waves of ``target_items``).
    """
    tiles = num_tiles(seq_lens)
    chunk = balanced_chunk_tiles(tiles, num_kv_heads, target_items, min_chunk_tiles)
    return ((tiles + chunk - 1) // chunk).astype(np.int32)


def max_workqueue_items(batch_size: int, num_kv_heads: int, target_items: int) -> int:
    """Upper bound on balanced work-queue items for any lengths (see balanced_chunk_tiles): the
    fixed grid of a GPU-planned launch, so a captured graph stays valid when lengths change."""
    return queue_waves(batch_size, num_kv_heads, target_items) * target_items


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``decode`` (partials, or outputs for single-split rows), ``merge``
    (combines partial states), or ``fused`` (decode; the last CTA of each group merges).
    ``start:stop`` index ``Plan.items`` for decode/fused and ``Plan.merge_groups`` for merge."""

    kind: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class StepCounters:
    """Workload counters of one planned step (per layer)."""

    launches: int
    decode_ctas: int
    merge_ctas: int
    nonempty_items: int
    useful_kv_bytes: int
    padded_kv_bytes: int
    merge_state_bytes: int
    paper_merge_state_bytes: int
    h2d_bytes: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Plan:
    """What one decode step will launch; computed once per step, reused by every layer.

    items:        int32 [n, 4], see the module docstring
    merge_groups: int32 [m, 4], (row, kv_head, first partial slot, num_splits) for rows with S_i > 1
    row_splits:   int32 [B], S_i
    row_tokens:   int64 [B], tokens each row's items span (N_i, or the padded length)
    """

    route: str
    spec: AttentionSpec
    seq_lens: np.ndarray
    items: np.ndarray
    merge_groups: np.ndarray
    launches: tuple[Launch, ...]
    row_splits: np.ndarray
    row_tokens: np.ndarray
    params: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.size)

    @property
    def num_items(self) -> int:
        return int(self.items.shape[0])

    @property
    def fused_merge(self) -> bool:
        return any(launch.kind == "fused" for launch in self.launches)

    def counters(self) -> StepCounters:
        spec = self.spec
        tok_lo, tok_hi = self.items[:, 1], self.items[:, 2]
        split_counts = self.items[:, 3] >> 16
        multi = split_counts > 1
        partial_states = int(multi.sum())  # one per (row, kv head, split) with S_i > 1
        per_state = spec.group_size * 4
        useful = int(self.seq_lens.astype(np.int64).sum()) * spec.kv_bytes_per_token
        spanned = int(self.row_tokens.astype(np.int64).sum()) * spec.kv_bytes_per_token
        return StepCounters(
            launches=len(self.launches),
            decode_ctas=sum(l.size for l in self.launches if l.kind != "merge"),
            merge_ctas=sum(l.size for l in self.launches if l.kind == "merge"),
            nonempty_items=int((tok_hi > tok_lo).sum()),
            useful_kv_bytes=useful,
            padded_kv_bytes=spanned - useful,
            merge_state_bytes=partial_states * per_state * (spec.head_dim + PARTIAL_FLOATS_EXTRA),
            paper_merge_state_bytes=partial_states * per_state * (spec.head_dim + PAPER_PARTIAL_FLOATS_EXTRA),
            h2d_bytes=int(self.items.nbytes + self.merge_groups.nbytes),
        )


def _check_splits(num_splits: int) -> int:
    require(is_integer(num_splits) and 1 <= num_splits <= MAX_SPLITS,
            f"num_splits must be an integer in [1, {MAX_SPLITS}], got {num_splits!r}")
    return int(num_splits)


def _items_for_rows(rows: np.ndarray, span: np.ndarray, splits: np.ndarray, num_kv_heads: int,
                    keep_empty: bool) -> np.ndarray:
    """Items for ``rows`` whose items span ``span`` tokens, with S_i = ``splits``, in (row, kv head,
    split) order. Token ranges follow the row-local bound over the span's tiles, clipped to it."""
    rows = np.asarray(rows, dtype=np.int64)
    span = np.asarray(span, dtype=np.int64)
    splits = np.asarray(splits, dtype=np.int64)
    tiles = (span + TILE_TOKENS - 1) // TILE_TOKENS
    owner = np.repeat(np.arange(rows.size), splits)               # index into rows, per split
    first = np.repeat(np.cumsum(splits) - splits, splits)
    s = np.arange(owner.size) - first
    T, S, n = tiles[owner], splits[owner], span[owner]
    tok_lo = np.minimum((T * s) // S * TILE_TOKENS, n)
    tok_hi = np.minimum((T * (s + 1)) // S * TILE_TOKENS, n)
    keep = np.ones(owner.size, bool) if keep_empty else tok_hi > tok_lo
    owner, tok_lo, tok_hi = owner[keep], tok_lo[keep], tok_hi[keep]
    kept = np.bincount(owner, minlength=rows.size)              # K_r: splits kept per row
    offset = np.cumsum(kept) - kept
    pos = np.arange(owner.size) - offset[owner]                 # split index among kept
    heads = np.arange(num_kv_heads)[:, None]
    index = num_kv_heads * offset[owner][None, :] + heads * kept[owner][None, :] + pos[None, :]
    out = np.empty((owner.size * num_kv_heads, 4), dtype=np.int64)
    out[index, 0] = rows[owner][None, :] | (heads << 16)
    out[index, 1] = tok_lo[None, :]
    out[index, 2] = tok_hi[None, :]
    out[index, 3] = pos[None, :] | (kept[owner][None, :] << 16)
    return out.astype(np.int32)


def _merge_groups(block: np.ndarray, offset: int) -> np.ndarray:
    """(row, kv head, first slot, num_splits) for each group with more than one split in ``block``,
    whose first item sits at slot ``offset``."""
    split, nsplit = block[:, 3] & 0xFFFF, block[:, 3] >> 16
    first = np.flatnonzero((split == 0) & (nsplit > 1))
    rows, heads = block[first, 0] & 0xFFFF, block[first, 0] >> 16
    return np.stack([rows, heads, first + offset, nsplit[first]], axis=1).astype(np.int32).reshape(-1, 4)


def _assemble(route: str, batch: Batch, groups, params: dict, fused_merge: bool) -> Plan:
    """Build a Plan from per-launch item blocks: ``groups`` = [(items, row_splits_by_row), ...]."""
    spec = batch.spec
    items_parts, merge_parts, launches = [], [], []
    row_splits = np.zeros(batch.batch_size, dtype=np.int32)
    row_tokens = np.zeros(batch.batch_size, dtype=np.int64)
    cursor = merge_cursor = 0
    for block, rows, splits, spans in groups:
        start, stop = cursor, cursor + block.shape[0]
        items_parts.append(block)
        row_splits[rows] = splits
        row_tokens[rows] = spans
        cursor = stop
        if fused_merge:
            launches.append(Launch("fused", start, stop))
            continue
        launches.append(Launch("decode", start, stop))
        mg = _merge_groups(block, start)
        if mg.shape[0]:
            merge_parts.append(mg)
            launches.append(Launch("merge", merge_cursor, merge_cursor + mg.shape[0]))
            merge_cursor += mg.shape[0]
    items = np.concatenate(items_parts) if items_parts else np.zeros((0, 4), np.int32)
    if fused_merge:
        merge_groups = _merge_groups(items, 0)
    else:
        merge_groups = np.concatenate(merge_parts) if merge_parts else np.zeros((0, 4), np.int32)
    return Plan(route, spec, batch.seq_lens.copy(), items, merge_groups, tuple(launches),
                row_splits, row_tokens, params)


def _check_batch(batch: Batch) -> None:
    require(isinstance(batch, Batch), f"the planner takes a cache.Batch, got {type(batch).__name__}")
    require(batch.batch_size <= MAX_BATCH, f"batch size {batch.batch_size} exceeds {MAX_BATCH}")
    require(batch.spec.num_kv_heads <= MAX_KV_HEADS,
            f"num_kv_heads={batch.spec.num_kv_heads} exceeds {MAX_KV_HEADS} (packed into 15 bits)")


def plan_split(batch: Batch, num_splits: int, fused_merge: bool = False) -> Plan:
    """The rectangular grid: every (row, kv head, split) for one S, empty splits included."""
    _check_batch(batch)
    S = _check_splits(num_splits)
    rows = np.arange(batch.batch_size)
    splits = np.full(batch.batch_size, S, dtype=np.int32)
    block = _items_for_rows(rows, batch.seq_lens, splits, batch.spec.num_kv_heads, True)
    return _assemble("split", batch, [(block, rows, splits, batch.seq_lens)],
                     {"num_splits": S}, fused_merge)


def length_buckets(seq_lens: np.ndarray, bucket_tokens: int | None = None) -> list[tuple[int, np.ndarray]]:
    """Rows grouped by exact length (``bucket_tokens`` None) or by length rounded up to a multiple
    of ``bucket_tokens``; buckets in order of first appearance, rows in batch order."""
    seq = np.asarray(seq_lens, dtype=np.int64)
    if bucket_tokens is not None:
        require(is_integer(bucket_tokens) and bucket_tokens >= 1,
                f"bucket_tokens must be an integer >= 1 (or None for exact lengths), got {bucket_tokens!r}")
        seq = -(-seq // bucket_tokens) * bucket_tokens
    keys: dict[int, list[int]] = {}
    for row, key in enumerate(seq.tolist()):
        keys.setdefault(key, []).append(row)
    return [(key, np.asarray(rows, dtype=np.int64)) for key, rows in keys.items()]


def plan_buckets(batch: Batch, num_splits: int, bucket_tokens: int | None = None,
                 fused_merge: bool = False) -> Plan:
    """One rectangular launch (and merge) per length bucket, as published.

    ``bucket_tokens=None`` is the exact-length route; an integer gives padded buckets, whose
    items span the bucket length (the KV past N_i that a padded kernel reads shows up as
    ``padded_kv_bytes``; executors clip to N_i).
    """
    _check_batch(batch)
    S = _check_splits(num_splits)
    groups = []
    for bucket_len, rows in length_buckets(batch.seq_lens, bucket_tokens):
        spans = np.full(rows.size, bucket_len, dtype=np.int64)
        splits = np.full(rows.size, S, dtype=np.int32)
        block = _items_for_rows(rows, spans, splits, batch.spec.num_kv_heads, True)
        groups.append((block, rows, splits, spans))
    route = "buckets" if bucket_tokens is None else "padded_buckets"
    return _assemble(route, batch, groups, {"num_splits": S, "bucket_tokens": bucket_tokens}, fused_merge)


def plan_workqueue(batch: Batch, target_items: int | None = None, num_splits: int | None = None,
                   min_chunk_tiles: int = 1, fused_merge: bool = True) -> Plan:
    """The compact work queue: only non-empty items, one launch (merge fused) or a decode + merge pair.

    Split counts are balanced (:func:`balanced_chunk_tiles`) for ``target_items``, or
    ``min(num_splits, T_i)`` per row when a fixed ``num_splits`` is given (the published queue
    with its empty items dropped).
    """
    _check_batch(batch)
    require((target_items is None) != (num_splits is None), "give exactly one of target_items and num_splits")
    require(is_integer(min_chunk_tiles) and min_chunk_tiles >= 1,
            f"min_chunk_tiles must be an integer >= 1, got {min_chunk_tiles!r}")
    require(target_items is None or (is_integer(target_items) and target_items >= 1),
            f"target_items must be an integer >= 1, got {target_items!r}")
    if num_splits is not None:
        S = _check_splits(num_splits)
        splits = np.minimum(S, num_tiles(batch.seq_lens)).astype(np.int32)
        params = {"num_splits": S}
    else:
        tiles = num_tiles(batch.seq_lens)
        chunk = balanced_chunk_tiles(tiles, batch.spec.num_kv_heads, int(target_items), min_chunk_tiles)
        splits = ((tiles + chunk - 1) // chunk).astype(np.int32)
        params = {"target_items": int(target_items), "min_chunk_tiles": min_chunk_tiles, "chunk_tiles": chunk}
    require(int(splits.max()) <= MAX_SPLITS, f"a row needs more than {MAX_SPLITS} splits")
    rows = np.arange(batch.batch_size)
    block = _items_for_rows(rows, batch.seq_lens, splits, batch.spec.num_kv_heads, False)
    return _assemble("workqueue", batch, [(block, rows, splits, batch.seq_lens)], params, fused_merge)


#: route name -> its planner, and the options each takes (every parameter but the batch)
_PLANNERS = {"split": plan_split, "buckets": plan_buckets, "padded_buckets": plan_buckets,
             "workqueue": plan_workqueue}
_SIGNATURES = {route: inspect.signature(planner) for route, planner in _PLANNERS.items()}


def make_plan(batch: Batch, route: str, **options) -> Plan:
    """Dispatch by route name (names.PLAN_ROUTES: ``split``, ``buckets``, ``padded_buckets``,
    ``workqueue``); an option the route does not take is refused with the ones it does."""
    require(route in _PLANNERS, f"unknown route {route!r}; expected one of {', '.join(PLAN_ROUTES)}")
    if route == "padded_buckets":
        require(options.get("bucket_tokens") is not None, "padded_buckets needs bucket_tokens")
    signature = _SIGNATURES[route]
    accepted = [name for name in signature.parameters if name != "batch"]
    unknown = sorted(set(options) - set(accepted))
    require(not unknown, f"route {route} takes {', '.join(accepted)}; not {', '.join(unknown)}")
    try:
        signature.bind(batch, **options)
    except TypeError as exc:
        raise PKVError(f"route {route}: {exc}") from None
    return _PLANNERS[route](batch, **options)


def unpack_items(items: np.ndarray) -> dict[str, np.ndarray]:
    """Named columns of an item array (row, head, tok_lo, tok_hi, split, num_splits)."""
    return {
        "row": items[:, 0] & 0xFFFF, "head": items[:, 0] >> 16,
        "tok_lo": items[:, 1], "tok_hi": items[:, 2],
        "split": items[:, 3] & 0xFFFF, "num_splits": items[:, 3] >> 16,
    }
