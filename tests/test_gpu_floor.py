"""The one-kernel floor on a CUDA GPU (skipped, with the reason, anywhere else): the read kernel
reads every byte of each copy exactly once per launch, from every grid the floor tries, and the
floor's times are positive and grow with the bytes."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)"),
]


def xor_of(buffer) -> int:
    """The XOR of a uint8 buffer's 32-bit words (what the read kernel folds into its sink)."""
    words = buffer.cpu().numpy().view(np.uint32)
    return int(np.bitwise_xor.reduce(words))


def test_every_grid_reads_each_copy_whole():
    from persistentkv import ceiling
    from persistentkv.measure.device import TorchDevice

    device = TorchDevice("cuda")
    nbytes = 3 * 2**20 + 48                 # not a multiple of the grid's stride: the tail loop reads too
    n_vec = ceiling.floor_vectors(nbytes)
    reader = ceiling.CupyReader(device, 3, n_vec, seed=7)
    for slot in range(3):
        want = xor_of(reader.slot_bytes(slot))
        assert want != 0                    # random bytes: a dropped or repeated word would show
        for grid in ceiling.floor_grids(device.sm_count, n_vec):
            reader.sink.zero_()
            reader.launch(grid, slot)
            torch.cuda.synchronize()
            got = int(reader.sink.cpu().numpy().view(np.uint32)[0])
            assert got == want, (slot, grid)


def test_floor_times_are_positive_and_grow_with_the_bytes():
    from persistentkv import ceiling
    from persistentkv.measure.device import TorchDevice

    device = TorchDevice("cuda")
    small = ceiling.measure_floor(device, 4 * 2**20, repeats=5, warmup=2)
    large = ceiling.measure_floor(device, 256 * 2**20, repeats=5, warmup=2)
    for result in (small, large):
        assert result.grid in result.samples and all(t > 0 for v in result.samples.values() for t in v)
        assert result.copies * result.nbytes >= 3 * device.l2_bytes or result.copies == 64
        assert result.launches % result.copies == 0 and result.launches >= 10
    assert large.median_us > small.median_us
    # 256 MiB in one kernel cannot beat 20 TB/s on any GPU this runs on, nor take a millisecond on an H200-class one
    assert 256 * 2**20 / (large.median_us * 1e-6) < 20e12


def test_a_separated_floor_copies_every_time_and_still_reads_every_word():
    from persistentkv import ceiling
    from persistentkv.measure.device import TorchDevice

    device = TorchDevice("cuda")
    launches = []
    copy = device.separator(256 * 1024)

    def separator():
        launches.append(1)
        copy()

    result = ceiling.measure_floor(device, 16 * 2**20, repeats=3, warmup=1, separator=separator)
    assert set(result.separator_samples) == set(result.samples)
    assert all(len(v) == 3 and all(t > 0 for t in v) for v in result.separator_samples.values())
    assert all(t > 0 for v in result.samples.values() for t in v)   # the reads still cost time after the copy
    # captured once alone and once per grid (plus one eager launch): replays re-launch no Python
    assert len(launches) == 1 + result.launches * (1 + len(result.samples))
    sink_reader = ceiling.CupyReader(device, 1, ceiling.floor_vectors(4096), seed=3)
    copy()
    sink_reader.launch(132, 0)
    torch.cuda.synchronize()
    assert int(sink_reader.sink.cpu().numpy().view(np.uint32)[0]) == xor_of(sink_reader.slot_bytes(0))
