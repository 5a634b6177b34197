"""The development TMA path (engine defines=("PKV_TMA=1",): K/V tiles loaded by tensor-map boxes
into 128-byte-swizzled stages) against float64, at 4 and 8 warps: dtypes, G, page sizes >= 16,
ragged rows ending anywhere in a page or a stage (the zeroed tail), scattered pages, the host
routes (split, buckets) as well as the GPU queue, a cache of NaN-poisoned unused slots, and graph
replay. sm_90 only; skipped elsewhere with the reason.

As in test_gpu_engine.py, every case draws fresh inputs, poisons the output with NaN first (an
unwritten element fails) and compares with the float64 reference of tests/gpu_support.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_support import TOLERANCE, assert_graph_replay_matches, device_case, reference_torch64, rel_err, requires_gpu
from persistentkv.spec import AttentionSpec

pytestmark = [pytest.mark.gpu, requires_gpu]

TMA = ("PKV_TMA=1",)


def tma_engine(spec, warps):
    import torch

    from persistentkv.engine import engine_for

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA path needs sm_90")
    return engine_for(spec, warps=warps, defines=TMA)


def run(spec, lengths, warps, route="workqueue", seed=0, hole_fraction=0.3, poison_tail=False):
    import torch

    engine = tma_engine(spec, warps)
    batch, q, k, v = device_case(spec, lengths, hole_fraction, seed)
    if poison_tail:  # slots past each row's end in its last page hold NaN: they must weigh nothing
        P = spec.page_size
        for i, n in enumerate(batch.seq_lens):
            if n % P:
                last = int(batch.kv_indices[batch.kv_indptr[i + 1] - 1])
                k[last, n % P:] = float("nan")
                v[last, n % P:] = float("nan")
    plan = engine.plan(batch, route)
    out = torch.full_like(q, float("nan"))
    engine.run(q, (k, v), plan, out)
    torch.cuda.synchronize()
    return rel_err(out, reference_torch64(batch, q, k, v)), engine, plan, (batch, q, k, v)


def tail_lengths(P: int) -> list[int]:
    return sorted({1, 15, 16, 17, P - 1, P, P + 1, 63, 64, 65, 127, 128, 129, 255, 257, 1000, 3001, 8191})


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_tma_queue_matches_float64(warps, dtype, G):
    spec = AttentionSpec(8 * G, 8, 128, 16, dtype)
    err, *_ = run(spec, tail_lengths(16), warps, seed=G)
    assert err <= TOLERANCE[dtype], err


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("P", [16, 32, 64, 128])
@pytest.mark.parametrize("route", ["workqueue", "split", "buckets"])
def test_tma_page_sizes_and_routes_with_nan_past_each_row(warps, P, route):
    spec = AttentionSpec(32, 8, 128, P, "float16")
    err, *_ = run(spec, tail_lengths(P), warps, route=route, seed=P, poison_tail=True)
    assert err <= TOLERANCE["float16"], err


@pytest.mark.parametrize("warps", [4, 8])
def test_tma_long_rows_and_a_wide_batch(warps):
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    rng = np.random.default_rng(warps)
    err, *_ = run(spec, [131072 + 5], warps, seed=1)
    assert err <= TOLERANCE["float16"], err
    err, *_ = run(spec, rng.integers(1, 9000, size=96), warps, seed=2, hole_fraction=0.5)
    assert err <= TOLERANCE["float16"], err


@pytest.mark.parametrize("warps", [4, 8])
def test_tma_graph_replay_over_layers(warps):
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    err, engine, plan, (batch, q, k, v) = run(spec, [4099, 17, 8200], warps, seed=3)
    assert err <= TOLERANCE["float16"]
    assert_graph_replay_matches(engine, plan, batch, q, k, v, TOLERANCE["float16"])


def test_tma_refuses_what_it_cannot_load():
    from persistentkv.engine import engine_for
    from persistentkv.errors import PKVError

    with pytest.raises(PKVError, match="PKV_TMA needs"):
        engine_for(AttentionSpec(32, 8, 128, 8, "float16"), defines=TMA)
