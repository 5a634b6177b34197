"""The v11 prototype (benchmarks/pages_decode.cu, benchmarks/bench_pages.py): its page split on the
CPU, its compile for sm_90, and on the GPU its output against float64 on ragged rows, scattered
pages, page-boundary lengths and G in {1, 4, 8}, eagerly and in a graph of chained calls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpu_support import TOLERANCE, device_case, reference_torch64, rel_err, replay_captured, requires_gpu
from persistentkv.kernel_build import nvcc_path, parse_ptxas
from persistentkv.spec import AttentionSpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_pages  # noqa: E402


@pytest.mark.parametrize("lengths, ctas", [([4096], 132), ([1], 132), ([16, 17, 9000, 300], 132),
                                           ([65536] * 4, 132), ([5] * 300, 132), ([2049, 4096], 7)])
def test_split_pages_covers_each_row_once_in_about_one_wave(lengths, ctas):
    items, indptr = bench_pages.split_pages(np.asarray(lengths), 16, ctas)
    pages = [(n + 15) // 16 for n in lengths]
    assert indptr[0] == 0 and indptr[-1] == len(items) and len(indptr) == len(lengths) + 1
    for row, n in enumerate(pages):
        mine = items[indptr[row]:indptr[row + 1]]
        assert (mine[:, 0] == row).all()
        assert mine[0, 1] == 0 and mine[-1, 2] == n and (mine[1:, 1] == mine[:-1, 2]).all()  # contiguous cover
        sizes = mine[:, 2] - mine[:, 1]
        assert sizes.min() >= 1 and sizes.max() - sizes.min() <= 1  # near-equal ranges
        assert len(mine) == min(n, max(1, ctas * n // sum(pages)))
    # one wave, but for rows whose share is under one CTA (each still takes one)
    assert len(items) <= ctas + sum(ctas * n < sum(pages) for n in pages)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not on PATH")
def test_the_prototype_compiles_for_hopper_without_spills(tmp_path):
    cmd = [nvcc_path(), "-cubin", "-arch=sm_90", "-O3", "-std=c++17", "--use_fast_math", "-Xptxas", "-v",
           "-o", str(tmp_path / "x.cubin"), str(ROOT / "benchmarks" / "pages_decode.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["kernel"]: r for r in parse_ptxas(proc.stderr)}
    for name in ("pg_decode4", "pg_decode5", "pg_decode_fused4", "pg_decode_fused5", "pg_merge"):
        assert rows[name]["spill_store_bytes"] == 0 and rows[name]["registers"] <= 255, rows[name]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("ns", [4, 5])
@pytest.mark.parametrize("fused", [False, True], ids=["merge-kernel", "fused"])
@pytest.mark.parametrize("heads, lengths", [
    (32, [4096]), (32, [1, 16, 17, 31, 32, 33, 2049, 9000]), (8, [300, 70000]), (64, [5000, 16, 129]),
    (32, [16384] * 4), (32, [3] * 200 + [40000])])
def test_prototype_matches_float64(ns, fused, heads, lengths):
    import torch

    from persistentkv.errors import PKVError

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the prototype's bulk copies need sm_90")
    spec = AttentionSpec(heads, 8, 128, 16, "float16")
    batch, q, k, v = device_case(spec, lengths, hole_fraction=0.3, seed=len(lengths) + heads)
    module = bench_pages.load_module()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if fused and len(bench_pages.split_pages(batch.seq_lens, 16, sms)[0]) > sms:
        with pytest.raises(PKVError, match="needs one wave"):
            bench_pages.Pages(module, ns, batch, sms, fused=True)
        return
    plan = bench_pages.Pages(module, ns, batch, sms, fused=fused)
    out = torch.full_like(q, float("nan"))
    plan.run(q, (k, v), out)
    torch.cuda.synchronize()
    assert rel_err(out, reference_torch64(batch, q, k, v)) <= TOLERANCE["float16"]
    # Chained calls in one graph, each layer's q the previous output, against the eager chain.
    layers = 5
    outs = [torch.full_like(q, float("nan")) for _ in range(layers)]

    def chain():
        plan.run(q, (k, v), outs[0])
        for i in range(1, layers):
            plan.run(outs[i - 1], (k, v), outs[i])

    chain()
    torch.cuda.synchronize()
    eager = [o.clone() for o in outs]
    replay_captured(chain, outs)
    for i in range(layers):
        assert torch.equal(outs[i], eager[i]), f"graph layer {i} differs from the eager chain"
