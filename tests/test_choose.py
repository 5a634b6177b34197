"""choose.choose_warps, the one rule that picks a pkv-workqueue step's module (4 or 8 warps),
and the queue imbalance it rests on: worked numbers and the rule itself on random rows."""

from __future__ import annotations

import numpy as np
import pytest

from persistentkv.errors import PKVError


def test_queue_imbalance_worked_numbers():
    """Longest item over the mean work of the queue's slots (H200 queues: 264 items with 2-tile
    chunks at 4 warps, 132 with 4-tile chunks at 8 warps; Hkv = 8)."""
    from persistentkv.choose import queue_imbalance
    from persistentkv.plan import num_tiles

    zipf = num_tiles(np.array([13184, 14128, 14624, 15360, 16224, 16496, 17712, 19392]))
    assert zipf.sum() == 3974 and zipf.max() == 606
    # 8 warps: 64 (row, head) groups in 132 slots -> 2 items a row, the longest 303 tiles (9696
    # tokens) against a mean of 8 * 3974 / 132 tiles; 4 warps: 264 items of at most 138 tiles
    assert queue_imbalance(zipf, 8, 132, 4) == pytest.approx(303 * 132 / (8 * 3974))
    assert queue_imbalance(zipf, 8, 264, 2) == pytest.approx(138 * 264 / (8 * 3974))
    assert queue_imbalance(zipf.tolist(), 8, 264, 2) == queue_imbalance(zipf, 8, 264, 2)
    # 4 rows of 32 tiles: chunks of 4 tiles, 256 items in 264 slots
    assert queue_imbalance([32] * 4, 8, 264, 2) == pytest.approx(4 * 264 / (8 * 128))
    # one tile: the longest item is the whole row, whatever the chunk
    assert queue_imbalance([1], 8, 264, 4) == pytest.approx(264 / 8)
    # 64 rows x 8 heads = 512 groups: 4 waves of 132 slots, one item per group
    assert queue_imbalance([256] * 64, 8, 132, 4) == pytest.approx(256 * 528 / (8 * 64 * 256))


def test_choose_warps_worked_numbers():
    from persistentkv.choose import WARPS8_MAX_IMBALANCE, choose_warps

    assert choose_warps([8192], 128) == 8 and choose_warps([1], 64) == 8   # one row
    assert choose_warps([8192] * 4, 128) == 8 and choose_warps([7] * 16, 128) == 8   # equal rows
    # more (row, kv head) groups than the 8-warp queue's 132 slots, rows of at most 4K: 4 warps
    assert choose_warps([1024] * 64, 128) == 4 and choose_warps([4096] * 64, 128) == 4
    assert choose_warps([7] * 100, 128) == 4 and choose_warps([1024] * 17, 128) == 4    # 136 groups
    assert choose_warps(list(range(512, 4097, 8)), 128) == 4                           # ragged too
    assert choose_warps([2048] * 16, 128) == 8                        # 128 groups: one 8-warp wave
    assert choose_warps([4097] * 64, 128) == 8                        # a longer row: equal rows, 8
    assert choose_warps([1024] * 64, 128, queue8=(528, 4)) == 8       # an 8-warp queue with room for them
    assert choose_warps([1024] * 64, 128, num_kv_heads=2) == 8        # 128 groups
    zipf = [13184, 14128, 14624, 15360, 16224, 16496, 17712, 19392]
    assert choose_warps(zipf, 128) == 4                              # imbalance 1.258 vs 1.146
    assert choose_warps([50472, 6024, 10088, 10424], 128) == 8       # 1.116 vs 1.082
    assert choose_warps([49152, 4096, 8192, 6144, 40960, 8192, 6144, 7168], 128) == 4
    assert choose_warps([8192, 4096], 128) == 4                      # 1.117 vs 1.031
    assert choose_warps([8192, 8200], 128) == 8                      # 1.061 vs 1.029
    assert choose_warps([8192, 4096], 128, max_imbalance=1.09) == 8
    assert choose_warps([8192], 256) == 4                            # no 8-warp module at D=256
    assert choose_warps(zipf, 128, queue8=(264, 4)) == 8             # an 8-warp queue of as many items
    assert WARPS8_MAX_IMBALANCE == 1.05
    with pytest.raises(PKVError, match="at least one row"):
        choose_warps([], 128)


@pytest.mark.parametrize("rows", [2, 3, 64, 65, 512])
def test_choose_warps_is_the_imbalance_rule_on_both_paths(rows):
    """Up to 64 rows choose_warps works on Python lists, above it on numpy arrays; both give
    8 unless queue_imbalance(8-warp queue) > WARPS8_MAX_IMBALANCE x queue_imbalance(4-warp queue),
    and 8 for equal rows."""
    from persistentkv.choose import WARPS4_MULTIWAVE_MAX_TOKENS, WARPS8_MAX_IMBALANCE, choose_warps, queue_imbalance
    from persistentkv.plan import num_tiles

    rng = np.random.default_rng(rows)
    picked = set()
    for trial in range(60):
        seq = rng.integers(1, 1 << 18, size=rows).astype(np.int32)
        if trial % 3 == 0:  # near-equal rows, around the threshold
            seq = rng.integers(8000, 8000 + 64 * (trial % 9 + 1), size=rows).astype(np.int32)
        elif trial % 3 == 1:  # short rows: many of them make more groups than the 8-warp slots
            seq = rng.integers(1, WARPS4_MULTIWAVE_MAX_TOKENS + 1, size=rows).astype(np.int32)
        tiles = num_tiles(seq)
        ratio = queue_imbalance(tiles, 8, 132, 4) / queue_imbalance(tiles, 8, 264, 2)
        expect = 8 if seq.max() == seq.min() or ratio <= WARPS8_MAX_IMBALANCE else 4
        if rows * 8 > 132 and seq.max() <= WARPS4_MULTIWAVE_MAX_TOKENS:
            expect = 4
        assert choose_warps(seq, 128) == expect
        assert choose_warps(seq.tolist(), 128) == expect
        picked.add(expect)
    assert choose_warps(np.full(rows, 5000, dtype=np.int32), 128) == 8
    if rows <= 3:
        assert picked == {4, 8}  # the cases exercise both answers


