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
* Routes: ``split`` (the rectangular B x Hkv x S grid, empty splits included), ``buckets`` (rows
  grouped by exact length, one decode + merge launch pair per bucket), ``padded_buckets`` (rows
  grouped by length rounded up to a bucket size; ablation only), ``workqueue`` (only non-empty
  items, split counts balanced across rows, one launch with the merge fused in), ``cluster``
  (exactly C splits per (row, kv head), bounds on 64-token tiles, one launch; the C CTAs of a
  thread-block cluster merge on chip, through distributed shared memory, not global memory).

Item encoding, int32 ``[n, 4]``: ``(row | kv_head << 16, tok_lo, tok_hi, split | num_splits << 16)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from .cache import Batch
from .errors import PKVError, require
from .spec import AttentionSpec

#: Tokens per planning tile: split bounds fall on multiples of this (the paper's 32).
TILE_TOKENS = 32
#: Bytes of one partial state per query head as our kernels store it: o (D floats) + lse.
PARTIAL_FLOATS_EXTRA = 1
#: The paper's count per query head: acc (D floats) + m + l.
PAPER_PARTIAL_FLOATS_EXTRA = 2
ROUTES = ("split", "buckets", "padded_buckets", "workqueue", "cluster")
#: Tokens per tile of the cluster route's split bounds: one pipeline stage of the kernel (TILE) at
#: its default 4 warps; an 8-warp module's stage is 128 tokens, passed as ``tile`` (engine.stage_tokens).
CLUSTER_TILE_TOKENS = 64
#: CTAs per thread-block cluster the kernels are compiled for (16 is non-portable on sm_90).
CLUSTER_SIZES = (1, 2, 4, 8, 16)
#: The largest cluster the route picks by itself: 8, the portable limit. 16 runs only when asked
#: for (cluster_size=16): compute-sanitizer's synccheck reports barrier errors in 16-CTA clusters
#: that it does not report at 2, 4 or 8 on the same cases (benchmarks/NOTES.md, v5), and the
#: v5 bench measured no case where 16 beat 8 by more than 3 %.
DEFAULT_MAX_CLUSTER = 8
#: Compute capability (major) with thread-block clusters.
CLUSTER_MIN_MAJOR = 9
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
    require(target_items >= 1, f"target_items must be >= 1, got {target_items}")
    return (batch_size * num_kv_heads) // target_items + 1


#: How the balanced queue picks its chunk: ``"min"`` (default) the smallest chunk whose queue
#: fits whole waves, by search; ``"closed"`` the closed form that pays every row's ceil() up front
#: (the v2-v6 planner, kept for side-by-side benches).
CHUNK_RULES = ("min", "closed")


def _queue_items(tiles, chunk: int) -> int:
    """sum_i ceil(T_i / chunk) for a NumPy array or a plain list of tile counts."""
    if isinstance(tiles, np.ndarray):
        return int(((tiles + (chunk - 1)) // chunk).sum())
    return sum(-(-t // chunk) for t in tiles)


def balanced_chunk_tiles(tiles, num_kv_heads: int, target_items: int, min_chunk_tiles: int = 1,
                         chunk_rule: str = "min") -> int:
    """Tiles per work item for rows of ``tiles`` tiles: the queue must fit in whole waves.

    With W = queue_waves(B, Hkv, target) and cap = W * target, any chunk c with
    Hkv * sum_i ceil(T_i / c) <= cap fits. The closed form c = ceil(Hkv * sum_i T_i / (cap - B * Hkv))
    always does: Hkv * sum_i ceil(T_i / c) <= Hkv * (sum_i T_i / c + B) <= cap (every row's ceil()
    paid up front). ``chunk_rule="min"`` returns the smallest chunk (>= ``min_chunk_tiles``) that
    fits, found by bisection between ceil(Hkv * sum T / cap), below which nothing fits, and the
    closed form: the same split counts on uniform rows, but ragged rows fill the wave with shorter
    items instead of leaving slots empty. ``chunk_rule="closed"`` returns the closed form.

    Worked numbers (Hkv=8, target 264 = 2 CTAs x 132 SMs): B=1 at 4096 tokens (128 tiles): both
    rules give 4 tiles (128 tokens), 32 splits, 256 items. B=4 x 32768 (4096 tiles): the closed form
    is ceil(32768 / 232) = 142 and the smallest fit is 128 (8 * 4 * ceil(4096 / 128) = 256 <= 264),
    S_i = 8 either way. The B=8 lengths (49152, 4096, 8192, 6144, 40960, 8192, 6144, 7168): closed
    form 163 tiles (232 items, the longest 5120 tokens), smallest fit 128 (264 items, at most 4096).
    """
    require(min_chunk_tiles >= 1, f"min_chunk_tiles must be >= 1, got {min_chunk_tiles}")
    require(chunk_rule in CHUNK_RULES, f"chunk_rule must be one of {', '.join(CHUNK_RULES)}, got {chunk_rule!r}")
    batch_size = len(tiles)
    total = int(tiles.sum()) if isinstance(tiles, np.ndarray) else sum(tiles)
    cap = queue_waves(batch_size, num_kv_heads, target_items) * target_items
    room = cap - batch_size * num_kv_heads
    hi = max(min_chunk_tiles, -(-(num_kv_heads * total) // room))
    if chunk_rule == "closed":
        return hi
    lo = max(min_chunk_tiles, -(-(num_kv_heads * total) // cap))
    while lo < hi:  # invariant: hi fits; every chunk below lo does not (or is below the minimum)
        mid = (lo + hi) // 2
        if num_kv_heads * _queue_items(tiles, mid) <= cap:
            hi = mid
        else:
            lo = mid + 1
    return hi


def balanced_row_splits(seq_lens: np.ndarray, num_kv_heads: int, target_items: int,
                        min_chunk_tiles: int = 1, chunk_rule: str = "min") -> np.ndarray:
    """Split count per row: ceil(T_i / chunk) with one chunk size for the whole step.

    Long rows get many splits and short rows few, so items carry about equal work, and the item
    count stays within ``max_workqueue_items`` (whole waves of ``target_items``).
    """
    tiles = num_tiles(seq_lens)
    chunk = balanced_chunk_tiles(tiles, num_kv_heads, target_items, min_chunk_tiles, chunk_rule)
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
                  (route ``cluster``: the merges its clusters do on chip)
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
        on_chip = any(l.kind == "cluster" for l in self.launches)
        if on_chip:
            partial_states = 0  # merged through distributed shared memory: no global-memory states
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
            # the cluster kernel reads only lengths and the CSR row starts (it computes its ranges)
            h2d_bytes=int((2 * self.batch_size + 1) * 4 if on_chip else self.items.nbytes + self.merge_groups.nbytes),
        )


def _check_splits(num_splits: int) -> int:
    require(isinstance(num_splits, (int, np.integer)) and not isinstance(num_splits, bool)
            and 1 <= num_splits <= MAX_SPLITS, f"num_splits must be an integer in [1, {MAX_SPLITS}], got {num_splits!r}")
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
        require(bucket_tokens >= 1, f"bucket_tokens must be >= 1, got {bucket_tokens}")
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
                   min_chunk_tiles: int = 1, fused_merge: bool = True, chunk_rule: str = "min") -> Plan:
    """The compact work queue: only non-empty items, one launch (merge fused) or a decode + merge pair.

    Split counts are balanced (:func:`balanced_chunk_tiles`, by ``chunk_rule``) for ``target_items``, or
    ``min(num_splits, T_i)`` per row when a fixed ``num_splits`` is given (the published queue
    with its empty items dropped).
    """
    _check_batch(batch)
    require((target_items is None) != (num_splits is None), "give exactly one of target_items and num_splits")
    if num_splits is not None:
        S = _check_splits(num_splits)
        splits = np.minimum(S, num_tiles(batch.seq_lens)).astype(np.int32)
        params = {"num_splits": S}
    else:
        tiles = num_tiles(batch.seq_lens)
        chunk = balanced_chunk_tiles(tiles, batch.spec.num_kv_heads, int(target_items), min_chunk_tiles, chunk_rule)
        splits = ((tiles + chunk - 1) // chunk).astype(np.int32)
        params = {"target_items": int(target_items), "min_chunk_tiles": min_chunk_tiles, "chunk_tiles": chunk}
        if chunk_rule != "min":
            params["chunk_rule"] = chunk_rule
    require(int(splits.max()) <= MAX_SPLITS, f"a row needs more than {MAX_SPLITS} splits")
    rows = np.arange(batch.batch_size)
    block = _items_for_rows(rows, batch.seq_lens, splits, batch.spec.num_kv_heads, False)
    return _assemble("workqueue", batch, [(block, rows, splits, batch.seq_lens)], params, fused_merge)


POOL_UNITS = 16  #: the pool's share of a row's tiles is given in sixteenths (engine option ``pool``)


def check_pool(pool) -> int:
    """The engine's ``pool`` share (0 <= pool < 1, a multiple of 1/16) in sixteenths."""
    ok = isinstance(pool, (int, float, np.integer, np.floating)) and not isinstance(pool, bool)
    units = float(pool) * POOL_UNITS if ok else -1.0
    require(ok and 0 <= units < POOL_UNITS and units == int(units),
            f"pool must be a multiple of 1/{POOL_UNITS} in [0, 1), got {pool!r}")
    return int(units)


def pooled_items(items: np.ndarray, seq_lens: np.ndarray, pool_units: int, target_items: int) -> np.ndarray:
    """The work queue's items as the pooled kernel reads them: int32 [n, 6], (the four item words,
    pool_lo, pool_hi).

    With ``pool_units`` > 0 and the queue in one wave (n <= ``target_items``), each row split S >= 2
    ways keeps P = T * pool_units // 16 of its T tiles (of TILE_TOKENS) out of its items: split s
    statically owns tokens [min(N, Ts * s // S * TILE_TOKENS), min(N, Ts * (s + 1) // S * TILE_TOKENS))
    with Ts = T - P (the balanced ranges of plan_workqueue over Ts tiles), and the rest of the
    row, [min(N, Ts * TILE_TOKENS), N), is the (row, kv head)'s pool, which the group's CTAs claim
    a kernel stage at a time from a counter once their own tokens are issued: CTAs that stream
    faster take more of it. Everything else keeps its range and gets an empty pool (0, 0).
    pkv_plan computes the same on the device (tests check that they agree)."""
    items = np.asarray(items, dtype=np.int64).reshape(-1, 4)
    out = np.zeros((items.shape[0], 6), dtype=np.int64)
    out[:, :4] = items
    if pool_units <= 0 or items.shape[0] > target_items:
        return out.astype(np.int32)
    row, s, S = items[:, 0] & 0xFFFF, items[:, 3] & 0xFFFF, items[:, 3] >> 16
    N = np.asarray(seq_lens, dtype=np.int64)[row]
    T = (N + TILE_TOKENS - 1) // TILE_TOKENS
    Ts = T - T * pool_units // POOL_UNITS
    on = (S >= 2) & (Ts < T)
    out[on, 1] = np.minimum(N, Ts * s // S * TILE_TOKENS)[on]
    out[on, 2] = np.minimum(N, Ts * (s + 1) // S * TILE_TOKENS)[on]
    out[on, 4] = np.minimum(N, Ts * TILE_TOKENS)[on]
    out[on, 5] = N[on]
    return out.astype(np.int32)


def check_cluster_size(cluster_size: int) -> int:
    require(isinstance(cluster_size, (int, np.integer)) and not isinstance(cluster_size, bool)
            and int(cluster_size) in CLUSTER_SIZES,
            f"cluster_size must be one of {', '.join(map(str, CLUSTER_SIZES))}, got {cluster_size!r}")
    return int(cluster_size)


def default_cluster_size(batch_size: int, num_kv_heads: int, num_sms: int) -> int:
    """The largest C in CLUSTER_SIZES, at most DEFAULT_MAX_CLUSTER, with B * Hkv * C <= num_sms:
    one CTA per SM, one wave.

    H200 (132 SMs), Hkv=8: B=1 -> 8 (64 CTAs), B=2 -> 8, B=4 -> 4, B=8 -> 2, B>=16 -> 1.
    """
    pairs = batch_size * num_kv_heads
    fits = [c for c in CLUSTER_SIZES if pairs * c <= num_sms and c <= DEFAULT_MAX_CLUSTER]
    return max(fits) if fits else 1


def check_cluster_tile(tile: int) -> int:
    """The cluster route's tile must be a kernel stage: a positive multiple of TILE_TOKENS."""
    require(isinstance(tile, (int, np.integer)) and not isinstance(tile, bool) and tile > 0
            and tile % TILE_TOKENS == 0,
            f"cluster tile must be a positive multiple of {TILE_TOKENS} tokens (the kernel's stage), got {tile!r}")
    return int(tile)


def cluster_split_bounds(seq_len: int, cluster_size: int, rank: int,
                         tile: int = CLUSTER_TILE_TOKENS) -> tuple[int, int]:
    """Tokens [lo, hi) of split ``rank`` of ``cluster_size`` over a row of ``seq_len`` tokens, as
    pkv_decode_cluster computes them with its stage of ``tile`` tokens: n = ceil(N / tile),
    lo = min(N, n * rank // C * tile)."""
    tile = check_cluster_tile(tile)
    tiles = -(-int(seq_len) // tile)
    lo = min(int(seq_len), tiles * rank // cluster_size * tile)
    hi = min(int(seq_len), tiles * (rank + 1) // cluster_size * tile)
    return lo, hi


def plan_cluster(batch: Batch, cluster_size: int, tile: int = CLUSTER_TILE_TOKENS) -> Plan:
    """The host equivalent of the cluster route (for counters and tests; the kernel computes its
    own ranges): every (row, kv head, rank) in grid order, empty splits included, one launch.

    Item ``(row * Hkv + head) * C + rank`` is CTA ``blockIdx.x``; ranges follow
    :func:`cluster_split_bounds`, the row-local bound over tiles of ``tile`` tokens (the kernel
    module's stage: 64 at 4 warps, 128 at 8), so the counters match what the kernel reads.
    """
    _check_batch(batch)
    C = check_cluster_size(cluster_size)
    tile = check_cluster_tile(tile)
    Hkv, B = batch.spec.num_kv_heads, batch.batch_size
    seq = batch.seq_lens.astype(np.int64)
    tiles = -(-seq // tile)
    rank = np.arange(C, dtype=np.int64)
    lo = np.minimum(seq[:, None], tiles[:, None] * rank[None, :] // C * tile)
    hi = np.minimum(seq[:, None], tiles[:, None] * (rank[None, :] + 1) // C * tile)
    items = np.empty((B, Hkv, C, 4), dtype=np.int64)
    items[..., 0] = np.arange(B)[:, None, None] | (np.arange(Hkv)[None, :, None] << 16)
    items[..., 1] = lo[:, None, :]
    items[..., 2] = hi[:, None, :]
    items[..., 3] = rank[None, None, :] | (C << 16)
    items = items.reshape(-1, 4).astype(np.int32)
    # merge_groups name the on-chip merges (for execute_plan); nothing of them is uploaded
    return Plan("cluster", batch.spec, batch.seq_lens.copy(), items, _merge_groups(items, 0),
                (Launch("cluster", 0, items.shape[0]),), np.full(B, C, dtype=np.int32),
                batch.seq_lens.astype(np.int64), {"cluster_size": C, "tile": tile})


#: choose_route: a cluster grid is used only when no row is longer than this multiple of the mean
#: (the longest row's CTAs are the step's tail; the queue balances ragged rows instead).
CLUSTER_MAX_SKEW = 1.25
#: choose_route's window of tokens per CTA (the longest row over C), from the H200 dev bench of
#: kernel v5 (results/nvidia-h200/kernel_dev/bench_cluster_v5.parquet, benchmarks/NOTES.md): with
#: at most 256 tokens per CTA the step is all fixed cost and the on-chip merge wins (B=1 x 1K at
#: C=8: 6.8 us against the queue's 8.1); from 512 tokens per CTA on, the cluster grid's one CTA per
#: (SM, split) reads slower than the queue's two waves of resident CTAs and loses (B=1 x 8K: 17.5
#: against 16.6 us; x 32K: 50.2 against 40.9). 128 tokens per CTA was faster than 64 (1K: C=8 6.8,
#: C=16 7.3 us).
CLUSTER_MIN_TOKENS_PER_CTA = 128
CLUSTER_MAX_TOKENS_PER_CTA = 256


def choose_route(seq_lens, num_kv_heads: int, num_sms: int, *, max_skew: float = CLUSTER_MAX_SKEW,
                 min_tokens_per_cta: int = CLUSTER_MIN_TOKENS_PER_CTA,
                 max_tokens_per_cta: int = CLUSTER_MAX_TOKENS_PER_CTA) -> tuple[str, int | None]:
    """``("cluster", C)`` when a one-wave cluster grid would be all fixed cost, else ``("workqueue", None)``.

    C starts at :func:`default_cluster_size` (B * Hkv * C <= num_sms) and halves while the longest
    row would give a CTA fewer than ``min_tokens_per_cta`` tokens; the cluster route is taken when
    C >= 2, the longest row gives each CTA at most ``max_tokens_per_cta`` tokens, and
    max(N) <= max_skew * mean(N). Worked numbers (H200, 132 SMs, Hkv=8): B=1 x 1K -> C=8 (128
    tokens per CTA); B=1 x 2K -> C=8 (256); B=1 x 4K -> 512 per CTA -> workqueue; B=1 x 100 -> C=1
    -> workqueue; B=16 -> C=1 -> workqueue; lengths (2K, 512) -> skew 1.6 -> workqueue.
    """
    seq = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    require(seq.size >= 1, "choose_route needs at least one row")
    require(0 < min_tokens_per_cta <= max_tokens_per_cta,
            f"need 0 < min_tokens_per_cta <= max_tokens_per_cta, got {min_tokens_per_cta}, {max_tokens_per_cta}")
    C = default_cluster_size(int(seq.size), int(num_kv_heads), int(num_sms))
    longest = int(seq.max())
    while C >= 2 and longest < min_tokens_per_cta * C:
        C //= 2
    if C < 2 or -(-longest // C) > max_tokens_per_cta or float(longest) > max_skew * float(seq.mean()):
        return "workqueue", None
    return "cluster", C


def queue_imbalance(tiles, num_kv_heads: int, target_items: int, min_chunk_tiles: int = 1) -> float:
    """The balanced queue's longest item over the mean work of its ``W * target_items`` slots
    (W = queue_waves): 1.0 when every slot carries the same work, 1.25 when the longest item is a
    quarter longer than that mean. A one-item-per-CTA queue takes about as long as its longest
    item, so this is the factor the step's per-row chunking costs over a perfect spread."""
    B = len(tiles)
    total = int(tiles.sum()) if isinstance(tiles, np.ndarray) else sum(tiles)
    chunk = balanced_chunk_tiles(tiles, num_kv_heads, target_items, min_chunk_tiles)
    longest = min(chunk, int(max(tiles)))
    cap = queue_waves(B, num_kv_heads, target_items) * target_items
    return longest * cap / (num_kv_heads * total)


#: choose_warps: the 8-warp module (one 192 KB CTA per SM, 128-token stages, a queue of one item
#: per SM) unless its queue's imbalance exceeds the 4-warp queue's (two CTAs per SM, twice the
#: items, so shorter ones) by more than this factor. From the H200 dev bench of 7ff41ed
#: (results/nvidia-h200/kernel_dev/bench_warps_waves_7ff41ed.parquet, benchmarks/NOTES.md "Host:
#: the warps by the queue's balance"): time(8 warps) / time(4 warps) follows ~0.97 x the
#: imbalance ratio: 0.97-0.99 on equal rows (ratio 1.00-1.02), 0.969 at B=4 6K-50K (1.032), 1.052
#: and 1.074 at B=8 5.7K-22K and 13K-19K (1.084, 1.098), 1.08 and 1.32 on B8-bimodal and B8-ragged
#: (1.20, 1.50).
WARPS8_MAX_IMBALANCE = 1.05
#: More (row, kv head) groups than the 8-warp queue has slots and no row longer than this: 4 warps.
#: Each group is then one item and the 8-warp queue runs several waves of one CTA per SM, whose
#: every item pays its first stage's latency with nothing else on the SM, where two 4-warp CTAs
#: per SM overlap one's ramp with the other's stream. H200 (benchmarks/NOTES.md, "The warps of
#: many short rows"): 8-warp time / 4-warp time 1.125 at B=64 x 1K, 1.13 at B=32 x 1K, 1.06 at
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
    mean of 7704 (1.258), 4 warps 4395 against 3852 (1.146): ratio 1.098 -> 4; B=4 (50472, 6024,
    10088, 10424): 1.116 against 1.082, ratio 1.032 -> 8; head_dim 256 -> 4."""
    # Runs on every pkv-workqueue step's host path: one row and equal rows return before any
    # planning; ragged rows pay two chunk searches, remembered per tile counts (a decode step's
    # rows grow by a token, so its tiles change only when a row crosses a 32-token boundary).
    seq = seq_lens if isinstance(seq_lens, np.ndarray) and seq_lens.ndim == 1 else \
        np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    require(seq.size >= 1, "choose_warps needs at least one row")
    if head_dim > 128:
        return 4
    if seq.size == 1:
        return 8
    many_waves = seq.size * num_kv_heads > queue8[0]  # every group an item, more than the 8-warp slots
    if seq.size <= 64:  # plain Python over a few rows costs less than numpy's calls
        lens = seq.tolist()
        longest = max(lens)
        if many_waves and longest <= WARPS4_MULTIWAVE_MAX_TOKENS:
            return 4
        if longest == min(lens):
            return 8
        key = tuple(-(-n // TILE_TOKENS) for n in lens)
    else:
        longest = int(seq.max())
        if many_waves and longest <= WARPS4_MULTIWAVE_MAX_TOKENS:
            return 4
        if longest == seq.min():
            return 8
        key = num_tiles(seq).tobytes()  # int64 tile counts
    return _warps_for_tiles(key, num_kv_heads, tuple(queue4), tuple(queue8), float(max_imbalance))


@functools.lru_cache(maxsize=1024)  # keys of up to 8 bytes a row: <= 4 MB at B = 512
def _warps_for_tiles(tiles, num_kv_heads: int, queue4: tuple, queue8: tuple, max_imbalance: float) -> int:
    """choose_warps's rule for ragged rows of ``tiles`` tiles: a tuple, or the bytes of an int64
    array (more than 64 rows); memoised."""
    counts = np.frombuffer(tiles, dtype=np.int64) if isinstance(tiles, bytes) else list(tiles)
    imbalance4 = queue_imbalance(counts, num_kv_heads, *queue4)
    imbalance8 = queue_imbalance(counts, num_kv_heads, *queue8)
    return 4 if imbalance8 > max_imbalance * imbalance4 else 8


def make_plan(batch: Batch, route: str, **options) -> Plan:
    """Dispatch by route name (``split``, ``buckets``, ``padded_buckets``, ``workqueue``, ``cluster``)."""
    if route == "split":
        return plan_split(batch, **options)
    if route == "buckets":
        return plan_buckets(batch, **options)
    if route == "padded_buckets":
        require(options.get("bucket_tokens") is not None, "padded_buckets needs bucket_tokens")
        return plan_buckets(batch, **options)
    if route == "workqueue":
        return plan_workqueue(batch, **options)
    if route == "cluster":
        return plan_cluster(batch, **options)
    raise PKVError(f"unknown route {route!r}; expected one of {', '.join(ROUTES)}")


def unpack_items(items: np.ndarray) -> dict[str, np.ndarray]:
    """Named columns of an item array (row, head, tok_lo, tok_hi, split, num_splits)."""
    return {
        "row": items[:, 0] & 0xFFFF, "head": items[:, 0] >> 16,
        "tok_lo": items[:, 1], "tok_hi": items[:, 2],
        "split": items[:, 3] & 0xFFFF, "num_splits": items[:, 3] >> 16,
    }
