"""choose.choose_warps and choose_ctas_per_sm, the rules that pick a pkv-workqueue step's module
(4 or 8 warps; on an FP8 cache 3 or 4 resident 4-warp CTAs per SM), and the queue imbalance they
rest on.

Every expected value here is worked out by hand in the comments (tiles of 32 tokens, Hkv = 8, the
H200 queues: 132 items of >= 4 tiles at 8 warps, 264 items of >= 2 tiles at 4 warps) or by the
brute-force oracle below, which follows the documented rule with a plain linear search and shares
no code with persistentkv.choose or persistentkv.plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from persistentkv.choose import (CTAS_MAX_IMBALANCE, CTAS_MIN_ITEM_TOKENS, CTAS_RAGGED_MAX_IMBALANCE, CTAS_RAGGED_ORDER,
                                 _warps_for_tiles, choose_ctas_per_sm, choose_warps, queue_imbalance)
from persistentkv.errors import PKVError
from persistentkv.names import BENCH_EXTRA

ROOT = Path(__file__).resolve().parents[1]

# zipf_b8's step: tiles 412, 442, 457, 480, 507, 516, 554, 606 (ceil(n / 32)); 3974 tiles in all.
ZIPF_B8 = [13184, 14128, 14624, 15360, 16224, 16496, 17712, 19392]


def tiles_of(lens):
    return [-(-n // 32) for n in lens]


# -- an oracle written from the docstrings, not from the code --------------------------------

def oracle_chunk(tiles, hkv, target, min_chunk):
    """(the smallest chunk (>= min_chunk) whose Hkv x sum ceil(T / chunk) items fit the slots,
    the slots): target items a wave, as many waves as it takes for one item per (row, kv head)
    group to leave at least one slot spare."""
    tiles = [int(t) for t in tiles]
    waves = 1
    while waves * target <= len(tiles) * hkv:
        waves += 1
    slots = waves * target
    chunk = max(min_chunk, -(-hkv * sum(tiles) // slots))  # fewer tiles an item than total / slots never fit
    while hkv * sum(-(-t // chunk) for t in tiles) > slots:
        chunk += 1
    return chunk, slots


def oracle_imbalance(tiles, hkv, target, min_chunk):
    """Longest item x slots / (Hkv x total tiles) at oracle_chunk's chunk."""
    chunk, slots = oracle_chunk(tiles, hkv, target, min_chunk)
    return min(chunk, max(tiles)) * slots / (hkv * sum(int(t) for t in tiles))


def oracle_warps(lens, hkv=8, max_imbalance=1.05):
    if len(lens) == 1:
        return 8
    if len(lens) * hkv > 132 and max(lens) <= 4096:
        return 4
    if max(lens) == min(lens):
        return 8
    tiles = tiles_of(lens)
    ratio = oracle_imbalance(tiles, hkv, 132, 4) / oracle_imbalance(tiles, hkv, 264, 2)
    return 4 if ratio > max_imbalance else 8


# -- queue_imbalance on cases worked by hand ---------------------------------------------------

def test_queue_imbalance_is_one_when_every_slot_carries_the_same_work():
    # 4 rows of 64 tiles, 256 slots: 32 groups, chunk 8 gives 8 items a group, 256 items of 8 tiles.
    assert queue_imbalance([64] * 4, 8, 256, 1) == pytest.approx(1.0)
    # one row of 33 tiles, 264 slots: one-tile items, 33 a head, 264 in all.
    assert queue_imbalance([33], 8, 264, 1) == pytest.approx(1.0)
    assert queue_imbalance(np.array([64] * 4), 8, 256, 1) == pytest.approx(1.0)


def test_queue_imbalance_zipf_b8_worked_by_hand():
    # 8 warps, 132 slots: at most 132 / 8 = 16 items a head over 8 rows, so 2 a row. Chunk 303 does
    # it (606 / 303 = 2, the rest are shorter); chunk 302 gives the 606-tile row 3 items (17).
    # Longest item 303 tiles against a mean of 8 x 3974 / 132 tiles a slot.
    assert queue_imbalance(tiles_of(ZIPF_B8), 8, 132, 4) == pytest.approx(303 * 132 / (8 * 3974))
    # 4 warps, 264 slots: at most 33 items a head. Chunk 138: 3+4+4+4+4+4+5+5 = 33; chunk 137:
    # 412 / 137 > 3 gives 4+4+4+4+4+4+5+5 = 34. Longest 138 tiles against 8 x 3974 / 264.
    assert queue_imbalance(tiles_of(ZIPF_B8), 8, 264, 2) == pytest.approx(138 * 264 / (8 * 3974))


def test_queue_imbalance_longest_item_is_at_most_the_row():
    # one tile of one row: whatever the minimum chunk, the only item is one tile; 264 slots hold
    # 8 of them.
    assert queue_imbalance([1], 8, 264, 4) == pytest.approx(264 / 8)
    # two rows of 5 tiles under a minimum chunk of 8: one item per group, each 5 tiles.
    assert queue_imbalance([5, 5], 8, 264, 8) == pytest.approx(5 * 264 / (8 * 10))


def test_queue_imbalance_many_waves():
    # 64 rows x 8 heads = 512 groups > 132: four waves hold them with room (528 slots); 512 items
    # of one whole row (256 tiles) each, 16 slots empty.
    assert queue_imbalance([256] * 64, 8, 132, 4) == pytest.approx(528 / 512)
    # exactly one wave's worth of groups (33 x 8 = 264) still takes a second wave: 528 slots,
    # 264 groups of 2 tiles split into 1-tile items, 528 of them.
    assert queue_imbalance([2] * 33, 8, 264, 1) == pytest.approx(1.0)


# -- choose_warps on the docstring's worked numbers --------------------------------------------

def test_choose_warps_documented_cases():
    assert choose_warps([8192], 128) == 8 and choose_warps([1], 64) == 8 and choose_warps([300000], 128) == 8
    assert choose_warps([8192], 256) == 4 and choose_warps([8192, 100], 256) == 4     # no 8-warp module
    assert choose_warps([8192] * 4, 128) == 8                                         # equal rows
    assert choose_warps([2048] * 16, 128) == 8                                        # 128 groups: one wave
    for n in (1024, 2048, 4096):
        assert choose_warps([n] * 64, 128) == 4, n                                    # 512 groups, <= 4K
    assert choose_warps([8192] * 64, 128) == 8                                        # longer rows, equal
    # zipf_b8: 303 x 132 / (138 x 264) = 303 / 276 = 1.098 > 1.05
    assert choose_warps(ZIPF_B8, 128) == 4
    # B=4 (50472, 6024, 10088, 10424), tiles 1578, 189, 316, 326 (2409): 8 warps chunk 163
    # (10+2+2+2 = 16; 162 gives 326 three items), 4 warps chunk 79 (20+3+4+5 = 32; 78 gives 34):
    # ratio 163 x 132 / (79 x 264) = 163 / 158 = 1.032 <= 1.05
    assert choose_warps([50472, 6024, 10088, 10424], 128) == 8


def test_choose_warps_small_ragged_cases_worked_by_hand():
    # (8192, 4096), tiles 256 + 128: 8 warps chunk 26 (10 + 5 = 15 <= 16; 25 gives 11 + 6),
    # 4 warps chunk 12 (22 + 11 = 33; 11 gives 24 + 12): ratio 26 x 132 / (12 x 264) = 13 / 12.
    assert choose_warps([8192, 4096], 128) == 4
    assert choose_warps([8192, 4096], 128, max_imbalance=13 / 12 + 1e-9) == 8
    assert choose_warps([8192, 4096], 128, max_imbalance=13 / 12 - 1e-9) == 4
    # (8192, 8200), tiles 256 + 257: 8 warps chunk 33 (8 + 8; 32 gives 8 + 9), 4 warps chunk 16
    # (16 + 17 = 33; 15 gives 18 + 18): ratio 33 / 32 = 1.031 -> 8.
    assert choose_warps([8192, 8200], 128) == 8
    assert choose_warps([8192, 8200], 128, max_imbalance=33 / 32 - 1e-9) == 4


def test_choose_warps_flips_at_the_imbalance_ratio():
    """The answer turns from 4 to 8 exactly where max_imbalance passes the queues' ratio."""
    assert choose_warps(ZIPF_B8, 128, max_imbalance=303 / 276 - 1e-9) == 4
    assert choose_warps(ZIPF_B8, 128, max_imbalance=303 / 276 + 1e-9) == 8
    b4 = [50472, 6024, 10088, 10424]
    assert choose_warps(b4, 128, max_imbalance=163 / 158 - 1e-9) == 4
    assert choose_warps(b4, 128, max_imbalance=163 / 158 + 1e-9) == 8


def test_choose_warps_many_short_rows_edge():
    # 17 rows x 8 heads = 136 groups > 132 slots, rows <= 4096 tokens: 4 warps; 16 rows (128
    # groups) is one 8-warp wave, so the rule of the queues decides (equal rows: 8).
    assert choose_warps([1024] * 17, 128) == 4 and choose_warps([1024] * 16, 128) == 8
    assert choose_warps([4096] * 64, 128) == 4 and choose_warps([4097] * 64, 128) == 8
    # the same rows with fewer kv heads make 128 groups: one wave
    assert choose_warps([1024] * 64, 128, num_kv_heads=2) == 8
    # an 8-warp queue with slots for all 512 groups: not many waves, equal rows: 8
    assert choose_warps([1024] * 64, 128, queue8=(528, 4)) == 8
    # both paths: 64 rows (plain lists) and 65 (numpy)
    assert choose_warps([1024] * 65, 128) == 4 and choose_warps(np.full(65, 8192), 128) == 8


def test_choose_warps_equal_rows_take_8_whatever_the_queues():
    # 3 rows of 672 tokens (21 tiles, 63 in all), 24 groups: 8 warps chunk 5 (3 x 5 = 15 items a
    # head <= 16; 4 gives 18), 4 warps chunk 2 (3 x 11 = 33): ratio 5 x 132 / (2 x 264) = 1.25,
    # which would say 4; equal rows take 8 before the queues are weighed.
    assert queue_imbalance([21] * 3, 8, 132, 4) == pytest.approx(5 * 132 / (8 * 63))
    assert queue_imbalance([21] * 3, 8, 264, 2) == pytest.approx(2 * 264 / (8 * 63))
    assert choose_warps([672] * 3, 128) == 8
    # one token less in one row: the same tiles, but the rows differ, so the ratio decides
    assert choose_warps([672, 672, 671], 128) == 4
    # under a bound no queue meets, equal rows still take 8 on both paths; ragged rows take 4
    assert choose_warps([8192] * 3, 128, max_imbalance=0.5) == 8
    assert choose_warps(np.full(65, 8192), 128, max_imbalance=0.5) == 8
    assert choose_warps([8192] * 64 + [8193], 128, max_imbalance=0.5) == 4


def test_choose_warps_queue_arguments_change_the_answer():
    # an 8-warp queue of 264 items: the same chunks as the 4-warp queue's but >= 4 tiles; for
    # zipf_b8 both chunks are far above 4 tiles, so the imbalances are equal: 8.
    assert choose_warps(ZIPF_B8, 128, queue8=(264, 4)) == 8


def test_choose_warps_refuses_no_rows():
    with pytest.raises(PKVError, match="at least one row"):
        choose_warps([], 128)


# -- properties ----------------------------------------------------------------------------------

def random_rows(rng, rows, trial):
    if trial % 3 == 0:    # near-equal rows, around the threshold
        return rng.integers(8000, 8000 + 64 * (trial % 9 + 1), size=rows)
    if trial % 3 == 1:    # short rows: many of them make more groups than the 8-warp slots
        return rng.integers(1, 4097, size=rows)
    return rng.integers(1, 1 << 18, size=rows)


@pytest.mark.parametrize("rows", [2, 3, 16, 64, 65, 200])
def test_choose_warps_matches_the_documented_rule(rows):
    """Against the oracle, on both paths (lists up to 64 rows, numpy above)."""
    rng = np.random.default_rng(rows)
    picked = set()
    for trial in range(24):
        seq = random_rows(rng, rows, trial)
        expect = oracle_warps(seq.tolist())
        assert choose_warps(seq, 128) == expect
        assert choose_warps(seq.tolist(), 128) == expect
        assert choose_warps(seq.astype(np.int32), 128) == expect
        picked.add(expect)
    if rows <= 3:
        assert picked == {4, 8}  # the cases exercise both answers


@pytest.mark.parametrize("rows", [2, 5, 64, 100])
def test_queue_imbalance_matches_the_oracle(rows):
    rng = np.random.default_rng(100 + rows)
    for trial in range(10):
        tiles = tiles_of(random_rows(rng, rows, trial).tolist())
        for target, min_chunk in ((132, 4), (264, 2), (528, 1)):
            want = oracle_imbalance(tiles, 8, target, min_chunk)
            assert queue_imbalance(tiles, 8, target, min_chunk) == pytest.approx(want)
            assert queue_imbalance(np.array(tiles, dtype=np.int64), 8, target, min_chunk) == pytest.approx(want)


def test_choose_warps_ignores_row_order():
    rng = np.random.default_rng(7)
    for rows in (2, 8, 64, 90):
        for trial in range(6):
            seq = random_rows(rng, rows, trial)
            want = choose_warps(seq, 128)
            for _ in range(3):
                assert choose_warps(rng.permutation(seq), 128) == want


def test_choose_warps_is_monotone_in_max_imbalance():
    """A looser bound never turns 8 warps into 4."""
    rng = np.random.default_rng(11)
    bounds = [1.0, 1.01, 1.03, 1.05, 1.08, 1.12, 1.2, 1.5, 3.0]
    for trial in range(30):
        seq = random_rows(rng, 8, trial)
        answers = [choose_warps(seq, 128, max_imbalance=b) for b in bounds]
        assert answers == sorted(answers), (seq.tolist(), answers)


def test_memoised_answer_is_the_unmemoised_one():
    rng = np.random.default_rng(5)
    cases = [ZIPF_B8, [50472, 6024, 10088, 10424]] + [random_rows(rng, r, 2).tolist() for r in (3, 40, 80)]
    for lens in cases:
        _warps_for_tiles.cache_clear()
        first = choose_warps(lens, 128)
        hits = _warps_for_tiles.cache_info().hits
        assert choose_warps(lens, 128) == first                         # from the cache
        assert _warps_for_tiles.cache_info().hits == hits + 1
        key = tuple(tiles_of(lens)) if len(lens) <= 64 else np.array(tiles_of(lens), dtype=np.int64).tobytes()
        assert _warps_for_tiles.__wrapped__(key, 8, (264, 2), (132, 4), 1.05) == first
        assert first == oracle_warps(lens)
    # a remembered answer for one queue is not served for another
    _warps_for_tiles.cache_clear()
    assert choose_warps(ZIPF_B8, 128) == 4
    assert choose_warps(ZIPF_B8, 128, queue8=(264, 4)) == 8
    assert choose_warps(ZIPF_B8, 128, max_imbalance=1.2) == 8


# -- choose_ctas_per_sm: FP8 4-warp modules at 3 or 4 CTAs per SM ---------------------------------

def oracle_ctas(lens, hkv=8, sms=132, picked_queue=None, picked_warps=None, ragged_order=(3, 4)):
    """The documented rule with the oracle's imbalance: the first of 4, 3 CTAs per SM whose queue
    (ctas x sms items of >= 2 tiles, as many waves as one item per group needs) has a mean item of at
    least 4096 / 2048 tokens, or keeps every group one item, and an imbalance at most 1.02 / 1.07 x
    the picked module's queue's; failing both, where the picked module is the 8-warp one, the first
    of 3, 4 CTAs (``ragged_order``; 2c shipped 4, 3) whose imbalance is at most half that queue's."""
    tiles = tiles_of(lens)
    if picked_warps is None:
        picked_warps = oracle_warps(lens, hkv)
    if picked_queue is None:
        picked_queue = (264, 2) if picked_warps == 4 else (132, 4)
    base = oracle_imbalance(tiles, hkv, *picked_queue)
    for ctas, min_tokens, allowed in ((4, 4096, 1.02), (3, 2048, 1.07)):
        chunk, slots = oracle_chunk(tiles, hkv, ctas * sms, 2)
        if chunk < max(tiles) and 32 * hkv * sum(tiles) < min_tokens * slots:
            continue
        if oracle_imbalance(tiles, hkv, ctas * sms, 2) <= allowed * base:
            return ctas
    if picked_warps == 8:
        for ctas in ragged_order:
            if oracle_imbalance(tiles, hkv, ctas * sms, 2) <= 0.5 * base:
                return ctas
    return None


def picked(lens, hkv=8):
    """(the queue, the warps) of the module choose_warps picks on the H200 queues."""
    warps = choose_warps(lens, 128, num_kv_heads=hkv)
    return ((264, 2) if warps == 4 else (132, 4)), warps


def seeded_ragged_step(seed):
    """One of the seeded ragged steps the ragged CTA rule was fixed and measured on (NOTES, FP8,
    item 2c): B drawn from 4-128 rows, lengths lognormal around 2048 tokens (sigma 1, clipped to
    16-32768), one generator per seed."""
    rng = np.random.default_rng(seed)
    batch = int(rng.choice((4, 8, 16, 32, 64, 128)))
    return np.clip(rng.lognormal(np.log(2048), 1.0, batch).astype(int), 16, 32768)


def test_ctas_constants_are_the_documented_ones():
    assert CTAS_MIN_ITEM_TOKENS == {3: 2048, 4: 4096} and CTAS_MAX_IMBALANCE == {3: 1.07, 4: 1.02}
    assert CTAS_RAGGED_MAX_IMBALANCE == 0.5


@pytest.mark.parametrize("lens, want", [
    ([131072], 3),          # 8 x 4096 tiles over 396 slots: 2648 tokens an item; 4 CTAs: 1986 < 4096
    ([32768] * 4, 3),       # the same tokens in 4 rows
    ([16384] * 8, 3),
    ([8192] * 16, 3),       # 128 groups of 256 tiles: 3 items each (86 tiles), 1.039 against the 8-warp 1.031
    ([8192] * 64, 4),       # 512 one-item groups in 528 slots, 7944 tokens an item, 1.03 as the 8-warp queue's
    ([32768] * 64, 4),
    ([262144], 3),          # 4 CTAs: 3971 tokens an item, under 4096
    ([32768], None),        # 662 tokens an item at 3 CTAs
    ([65536], None),        # 1324
    ([1024] * 64, 4),       # 512 one-item groups in 528 slots: no item floor
    ([4096] * 64, 4),       # 3971 tokens an item, under 4096, but every group one item
    ([16] * 64, 4),
    (list(BENCH_EXTRA["B8-bimodal"]), 3),   # 3 CTAs balance 1.066 x worse than the 4-warp queue
    ([4096], None),         # 83 tokens an item at 3 CTAs, 32 groups split
])
def test_choose_ctas_worked_cases(lens, want):
    queue, warps = picked(lens)
    assert choose_ctas_per_sm(lens, 8, 132, queue, picked_warps=warps) == want
    assert oracle_ctas(lens) == want


@pytest.mark.parametrize("lens, want, by_item_rules", [
    # 16 groups of 469 tiles and 240 of 19: the 8-warp queue (one wave of 132) leaves its longest
    # items far above the mean (10.26); 3 CTAs balance it less than half as badly (1.74; 4: 1.18)
    ([15000] * 2 + [600] * 30, 3, False),
    ([15000] * 2 + [600] * 22, 4, False),     # 3 CTAs do not halve it (1.35 against 2.29); 4 do (1.07)
    ([16384] * 2 + [2048] * 62, 3, False),    # 4 CTAs do not halve it; 3 do
    ([16384] * 4 + [1024] * 60, 4, True),     # the item rules' answer already
])
def test_choose_ctas_ragged_8_warp_steps(lens, want, by_item_rules):
    """A ragged step on the 8-warp module that neither item rule moves goes to the first of 3, 4 CTAs
    whose queue is at most half as unbalanced (CTAS_RAGGED_MAX_IMBALANCE); a step the item rules
    place keeps their answer, and without picked_warps=8 the ragged rule is off."""
    queue, warps = picked(lens)
    assert warps == 8
    assert choose_ctas_per_sm(lens, 8, 132, queue, picked_warps=8) == want == oracle_ctas(lens)
    assert choose_ctas_per_sm(lens, 8, 132, queue) == (want if by_item_rules else None)
    if not by_item_rules:
        tiles = tiles_of(lens)
        assert oracle_imbalance(tiles, 8, want * 132, 2) <= 0.5 * oracle_imbalance(tiles, 8, 132, 4)


def test_the_ragged_rule_moves_the_seeded_steps_it_was_fixed_on():
    """Of the 200 seeded ragged steps of seeds 200-399 (2b's steps came from 0-199), the rule moves
    26 at Hkv=8, each B=32 to 3 or 4 CTAs or B=64 to 3 (the count it was fixed with; the first 10
    are the measured ones), none at Hkv=1, and no step the item rules give 3 or 4 CTAs changes."""
    moved = {}
    for seed in range(200, 400):
        seq = seeded_ragged_step(seed)
        for hkv in (8, 1):
            queue, warps = picked(seq, hkv)
            before = choose_ctas_per_sm(seq, hkv, 132, queue)
            after = choose_ctas_per_sm(seq, hkv, 132, queue, picked_warps=warps)
            assert after == oracle_ctas(seq.tolist(), hkv, picked_warps=warps)
            if before is not None:
                assert after == before
            elif after is not None:
                moved[seed, hkv] = (len(seq), after)
    assert len(moved) == 26 and all(hkv == 8 for _, hkv in moved)
    assert set(moved.values()) == {(32, 3), (32, 4), (64, 3)}
    assert [seed for seed, _ in moved][:10] == [209, 217, 224, 235, 246, 253, 267, 274, 276, 278]


def test_3_ctas_before_4_moves_the_steps_it_was_measured_on():
    """The fallback's order (CTAS_RAGGED_ORDER, item 2d): of seeds 400-799 at Hkv=8, the first 10
    steps it moves from 4 CTAs (2c's order) to 3 are the committed A/B cases, and it moves nothing
    else: no step to or from None, none the item rules decide."""
    assert CTAS_RAGGED_ORDER == (3, 4)
    with open(ROOT / "benchmarks/runs/fp8_ragged_3_before_4.cases.txt") as f:
        cases = [[int(n) for n in case.split(":")] for case in f.read().strip().split(",")]
    moved = []
    for seed in range(400, 800):
        seq = seeded_ragged_step(seed)
        queue, warps = picked(seq)
        now = choose_ctas_per_sm(seq, 8, 132, queue, picked_warps=warps)
        before = oracle_ctas(seq.tolist(), picked_warps=warps, ragged_order=(4, 3))
        assert now == oracle_ctas(seq.tolist(), picked_warps=warps)
        if now != before:
            assert (before, now, len(seq)) == (4, 3, 32) and choose_ctas_per_sm(seq, 8, 132, queue) is None
            moved.append(seed)
    assert moved[:10] == [416, 462, 466, 487, 500, 517, 554, 617, 668, 743]
    assert [seeded_ragged_step(seed).tolist() for seed in moved[:10]] == cases


def test_choose_ctas_imbalance_rules_out_a_partial_wave():
    """B=48 x 8K: 384 one-item groups. 3 CTAs hold them in one wave of 396 (1.03); 4 CTAs would
    leave 144 of 528 slots empty (1.375) and the 8-warp queue runs 3 waves (132 x 3 = 396: 1.03):
    3. B=64 x 8K at 3 CTAs (512 groups over 2 x 396 slots: 1.55) is ruled out the same way."""
    lens = [8192] * 48
    assert choose_ctas_per_sm(lens, 8, 132, (132, 4)) == 3
    assert queue_imbalance(tiles_of(lens), 8, 528, 2) == pytest.approx(1.375)
    assert queue_imbalance(tiles_of([8192] * 64), 8, 396, 2) == pytest.approx(256 * 792 / (8 * 64 * 256))
    assert choose_ctas_per_sm([8192] * 64, 8, 132, (132, 4), candidates=(3,)) is None


def test_choose_ctas_single_kv_head_keeps_the_module():
    """Hkv = 1 (a TP=8 shard): one group, items of 83-331 tokens at 3 CTAs (1.11-1.17x slower measured)."""
    for n in (32768, 131072):
        assert choose_ctas_per_sm([n], 1, 132, (132, 4)) is None


def test_choose_ctas_scales_with_the_sms():
    """The thresholds are per item, so fewer SMs make longer items: on 66 SMs B=1 x 128K has 264
    items of 3971 tokens at 4 CTAs (under 4096: 3 CTAs), B=1 x 256K 7944 (4 CTAs); on 33 SMs B=1 x
    32K has 99 items of 2648 tokens at 3 CTAs."""
    assert choose_ctas_per_sm([131072], 8, 66, (66, 4)) == 3
    assert choose_ctas_per_sm([262144], 8, 66, (66, 4)) == 4   # 8 x 262144 / 264 = 7944 tokens an item
    assert choose_ctas_per_sm([32768], 8, 33, (33, 4)) == 3    # 8 x 32768 / 99 = 2648


def test_choose_ctas_refuses_no_rows():
    with pytest.raises(PKVError, match="at least one row"):
        choose_ctas_per_sm([], 8, 132, (132, 4))


@pytest.mark.parametrize("rows", [1, 2, 8, 64, 100])
def test_choose_ctas_matches_the_documented_rule(rows):
    rng = np.random.default_rng(300 + rows)
    answers = set()
    for trial in range(20):
        seq = random_rows(rng, rows, trial)
        if trial % 4 == 3:
            seq = seq * 16  # long rows: the item thresholds within reach
        lens = seq.tolist()
        want = oracle_ctas(lens)
        queue, warps = picked(lens)
        assert choose_ctas_per_sm(seq, 8, 132, queue, picked_warps=warps) == want, lens
        answers.add(want)
    assert None in answers and (rows > 8 or 3 in answers)  # the cases exercise more than one answer


def test_choose_ctas_memoised_answer_is_the_unmemoised_one():
    """Remembered per tile counts and queues, as choose_warps' answer: a second call is a cache hit,
    the same answer as the rule run afresh (and as the oracle); another queue is asked again."""
    from persistentkv.choose import _ctas_for_tiles

    rng = np.random.default_rng(9)
    for lens in ([131072], [8192] * 64, [8192] * 48, [49152, 1024, 1024, 1024] * 2,
                 (rng.integers(1, 1 << 16, size=80) * 4).tolist()):
        _ctas_for_tiles.cache_clear()
        queue, warps = picked(lens)
        first = choose_ctas_per_sm(lens, 8, 132, queue, picked_warps=warps)
        hits = _ctas_for_tiles.cache_info().hits
        assert choose_ctas_per_sm(np.array(lens, dtype=np.int32), 8, 132, queue, picked_warps=warps) == first
        assert _ctas_for_tiles.cache_info().hits == hits + 1
        key = tuple(tiles_of(lens)) if len(lens) <= 64 else np.array(tiles_of(lens), dtype=np.int64).tobytes()
        assert _ctas_for_tiles.__wrapped__(key, 8, 132, queue, (4, 3), 2, warps == 8) == first == oracle_ctas(lens)
        choose_ctas_per_sm(lens, 8, 132, (1, 1), picked_warps=warps)
        assert _ctas_for_tiles.cache_info().misses == 2


# -- unsplit_min_chunk: many short groups get one item each --------------------------------------

def oracle_one_item_each(lens, hkv, target=132, min_chunk=4):
    """Whether the 8-warp queue of ``target`` slots, its smallest item raised to unsplit_min_chunk's
    answer, runs every (row, kv head) group as one item (oracle_chunk's chunk covers the longest row)."""
    from persistentkv.choose import unsplit_min_chunk

    raised = unsplit_min_chunk(lens, hkv)
    chunk, _ = oracle_chunk(tiles_of(lens), hkv, target, raised or min_chunk)
    return chunk >= max(tiles_of(lens))


def test_unsplit_constants_are_the_documented_ones():
    from persistentkv.choose import UNSPLIT_MAX_TOKENS, UNSPLIT_MIN_GROUPS

    assert (UNSPLIT_MIN_GROUPS, UNSPLIT_MAX_TOKENS) == (64, 512)


@pytest.mark.parametrize("lens, hkv, want", [
    ([512] * 8, 8, 16),       # 64 groups of 16 tiles; today 8 tiles an item: two each and a merge
    ([512] * 64, 1, 16),      # the TP=8 shard's 64 groups
    ([256] * 8, 8, 8),
    ([512] * 7 + [300], 8, 16),  # ragged: the longest row's tiles
    ([1] * 64, 1, 1),
    ([513] * 8, 8, None),     # a row over 512 tokens
    ([512] * 4, 8, None),     # 32 groups
    ([512] * 63, 1, None),
    ([2048] * 64, 1, None),   # longer rows lost unsplit (1.05x)
    ([4096], 8, None),
])
def test_unsplit_min_chunk_worked_cases(lens, hkv, want):
    from persistentkv.choose import unsplit_min_chunk

    assert unsplit_min_chunk(lens, hkv) == want
    assert unsplit_min_chunk(np.array(lens, dtype=np.int32), hkv) == want
    if want is not None and want > 4:  # split today (items >= 4 tiles); one item each raised
        assert oracle_chunk(tiles_of(lens), hkv, 132, 4)[0] < max(tiles_of(lens))
        assert oracle_one_item_each(lens, hkv)


def test_unsplit_min_chunk_refuses_no_rows():
    from persistentkv.choose import unsplit_min_chunk

    with pytest.raises(PKVError, match="at least one row"):
        unsplit_min_chunk([], 8)


class _Engine:
    """A stand-in for a DecodeEngine: the queue and module attributes pkv-workqueue's auto reads."""

    def __init__(self, warps=4, ctas_per_sm=None):
        self.warps, self.ctas_per_sm, self.num_sms = warps, ctas_per_sm, 132
        self.target_items = 132 * (ctas_per_sm or (2 if warps == 4 else 1))
        self.min_chunk_tiles = 4 if warps == 8 else 2


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3"], ids=["fp16", "fp8"])
@pytest.mark.parametrize("lens, hkv, want", [([512] * 8, 8, 16), ([256] * 64, 1, 8), ([768] * 8, 8, None),
                                             ([512] * 4, 8, None), ([512] * 64, 8, None), ([64] * 64, 1, None)])
def test_auto_raises_the_8_warp_queues_smallest_item_only_where_the_rule_says(monkeypatch, lens, hkv, want,
                                                                               kv_dtype):
    """pkv-workqueue's auto, with stand-in engines (the module choice is the backend's, the kernels
    the GPU tests'): the 8-warp module with min_chunk_tiles = unsplit_min_chunk where it applies, no
    option otherwise (64 rows of 64 tokens: 2 tiles, never split by items of >= 4); B=64 x 512 at
    Hkv=8 (512 groups) takes the 4-warp module, on an FP8 cache 4 CTAs per SM, untouched."""
    from persistentkv.backends import pkv
    from persistentkv.cache import make_batch
    from persistentkv.spec import AttentionSpec

    monkeypatch.setattr(pkv, "engine_for", lambda spec, warps=4, ctas_per_sm=None: _Engine(warps, ctas_per_sm))
    spec = AttentionSpec(8 * hkv, hkv, 128, 16, "float16", kv_dtype=kv_dtype)
    engine, options = pkv.PKVWorkqueue()._engine_for_step(make_batch(spec, lens, seed=1))
    many = len(lens) * hkv > 132
    assert (engine.warps, engine.ctas_per_sm) == ((4, 4 if kv_dtype else None) if many else (8, None))
    assert options == ({"min_chunk_tiles": want} if want else {})


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3"], ids=["fp16", "fp8"])
def test_auto_moves_a_ragged_8_warp_fp8_step_to_more_ctas(monkeypatch, kv_dtype):
    """pkv-workqueue's auto passes the module it picked to choose_ctas_per_sm: a ragged step on the
    8-warp module runs at 3 CTAs per SM on an FP8 cache (the ragged rule) and stays on the 8-warp
    module on an fp16 cache (no such modules there)."""
    from persistentkv.backends import pkv
    from persistentkv.cache import make_batch
    from persistentkv.spec import AttentionSpec

    monkeypatch.setattr(pkv, "engine_for", lambda spec, warps=4, ctas_per_sm=None: _Engine(warps, ctas_per_sm))
    spec = AttentionSpec(32, 8, 128, 16, "float16", kv_dtype=kv_dtype)
    engine, options = pkv.PKVWorkqueue()._engine_for_step(make_batch(spec, [15000] * 2 + [600] * 30, seed=1))
    assert (engine.warps, engine.ctas_per_sm) == ((4, 3) if kv_dtype else (8, None))
    assert options == {}
