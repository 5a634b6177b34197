"""The engine's API on the GPU, against float64: the softmax scale per plan, the LSE output, a
caller-owned workspace reused by a captured graph, lengths followed on the device, and one plan
shared by two streams and two host threads.

Every output is poisoned first and gated per (row, query head) against an independent float64
reference computed here (scores scaled by the plan's sm_scale; the LSE as torch.logsumexp of them).
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from gpu_support import assert_rows_close, device_case, replay_captured, requires_gpu
from persistentkv.names import ENGINE_ROUTES
from persistentkv.spec import AttentionSpec

pytestmark = [pytest.mark.gpu, requires_gpu]

CONFIGS = [(w, r) for w in (4, 8) for r in ENGINE_ROUTES]
CONFIG_IDS = [f"w{w}-{r}" for w, r in CONFIGS]
SPEC = AttentionSpec(32, 8, 128, 16, "float16")
#: Rows that are one item (direct store), split once (one-level merge) and split past the fused
#: merge's fan-in (two-level merge), with page- and stage-boundary lengths.
LENGTHS = [1, 17, 64, 129, 4096, 30001, 200000]


def reference64(batch, q, k, v, scale: float, lengths=None):
    """float64 (out [B, Hq, D], lse [B, Hq]) of softmax(scale * q.k) over each row's tokens: its
    first ``lengths[i]`` tokens (default the batch's lengths), within the pages the batch lists."""
    import torch

    spec = batch.spec
    G, D = spec.group_size, spec.head_dim
    out = torch.empty((batch.batch_size, spec.num_qo_heads, D), dtype=torch.float64, device="cuda")
    lse = torch.empty((batch.batch_size, spec.num_qo_heads), dtype=torch.float64, device="cuda")
    indices = torch.from_numpy(batch.kv_indices.astype(np.int64)).cuda()
    for i in range(batch.batch_size):
        n = int(batch.seq_lens[i] if lengths is None else lengths[i])
        pages = indices[int(batch.kv_indptr[i]):int(batch.kv_indptr[i + 1])]
        assert 1 <= n <= pages.numel() * spec.page_size
        for h in range(spec.num_kv_heads):
            kh = k[pages, :, h, :].reshape(-1, D)[:n].double()
            vh = v[pages, :, h, :].reshape(-1, D)[:n].double()
            s = (q[i, h * G:(h + 1) * G].double() @ kh.T) * scale
            lse[i, h * G:(h + 1) * G] = torch.logsumexp(s, dim=-1)
            out[i, h * G:(h + 1) * G] = torch.softmax(s, dim=-1) @ vh
    return out, lse


def assert_lse_close(lse, ref, what: str = "") -> None:
    """Per (row, head): |lse - ref| <= 1e-3 + 1e-4 |ref| (fp32 scores from fp16 inputs)."""
    import torch

    err = (lse.double() - ref).abs()
    bound = 1e-3 + 1e-4 * ref.abs()
    bad = ~(err <= bound)  # NaN counts as bad
    if bool(bad.any()):
        row, head = (int(x) for x in torch.nonzero(bad)[0])
        raise AssertionError(f"{what}: lse of row {row} head {head} is {float(lse[row, head]):.6g}, float64 "
                             f"{float(ref[row, head]):.6g}; {int(bad.sum())} (row, head) off")


def engine_of(spec, warps):
    from persistentkv.engine import engine_for

    return engine_for(spec, warps=warps)


def poisoned(q):
    import torch

    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    return out, lse


@pytest.mark.parametrize("warps, route", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("sm_scale", [None, 0.02, 0.3])
def test_lse_and_sm_scale(warps, route, sm_scale):
    import torch

    engine = engine_of(SPEC, warps)
    batch, q, k, v = device_case(SPEC, LENGTHS, seed=11)
    plan = engine.plan(batch, route, sm_scale=sm_scale)
    out, lse = poisoned(q)
    engine.run(q, (k, v), plan, out, lse=lse)
    torch.cuda.synchronize()
    ref, ref_lse = reference64(batch, q, k, v, 1 / math.sqrt(SPEC.head_dim) if sm_scale is None else sm_scale)
    what = f"w{warps} {route} sm_scale={sm_scale}"
    assert_rows_close(out, ref, SPEC.dtype, what)
    assert_lse_close(lse, ref_lse, what)
    # without lse the same plan writes the same output, bit for bit
    again = torch.full_like(q, float("nan"))
    engine.run(q, (k, v), plan, again)
    torch.cuda.synchronize()
    torch.testing.assert_close(again, out, rtol=0, atol=0)


@pytest.mark.parametrize("warps", [4, 8])
def test_graph_over_a_callers_workspace_follows_each_new_plan(warps):
    """A graph captured over run() of a plan in a caller's workspace stays right for later plans
    into that workspace with as many rows and block-table entries (FlashInfer's fixed buffers)."""
    import torch

    from persistentkv.cache import Batch

    engine = engine_of(SPEC, warps)
    lengths = [5000, 33, 70000, 1024]
    batch, q, k, v = device_case(SPEC, lengths, seed=3)
    ws = torch.empty(engine.workspace_bytes(batch.batch_size, batch.kv_indices.size), dtype=torch.uint8,
                     device="cuda")
    plan = engine.plan(batch, "workqueue", workspace=ws)
    out = torch.full_like(q, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        engine.run(q, (k, v), plan, out)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        engine.run(q, (k, v), plan, out)
    rng = np.random.default_rng(5)
    for step in range(3):
        # new lengths that need the same pages: as many rows and block-table entries, new items
        cap = np.diff(batch.kv_indptr) * SPEC.page_size
        new = (cap - rng.integers(0, SPEC.page_size, size=len(cap))).astype(np.int32)
        if step == 2:
            new[:] = cap - SPEC.page_size + 1  # one token in every row's last page
        moved = Batch(SPEC, new, batch.kv_indptr, batch.kv_indices, batch.num_pages)
        engine.plan(moved, "workqueue", workspace=ws)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = reference64(moved, q, k, v, 1 / math.sqrt(SPEC.head_dim))
        assert_rows_close(out, ref, SPEC.dtype, f"w{warps} replay {step} of a plan into the same workspace")


@pytest.mark.parametrize("warps", [4, 8])
def test_update_lengths_inside_a_graph(warps):
    """plan.update_lengths(lengths) captured with the layers: each replay reads the lengths the
    device holds then."""
    import torch

    engine = engine_of(SPEC, warps)
    batch, q, k, v = device_case(SPEC, [4096, 100, 20000], seed=9)
    plan = engine.plan(batch, "workqueue")
    lengths = torch.from_numpy(batch.seq_lens.copy()).cuda()
    outs = [torch.full_like(q, float("nan")) for _ in range(2)]

    def step():
        plan.update_lengths(lengths)
        for o in outs:
            engine.run(q, (k, v), plan, o)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    for new in ([4000, 99, 19990], [1, 1, 1], [4096, 100, 20000]):
        lengths.copy_(torch.tensor(new, dtype=torch.int32))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = reference64(batch, q, k, v, 1 / math.sqrt(SPEC.head_dim), lengths=new)
        for o in outs:
            assert_rows_close(o, ref, SPEC.dtype, f"w{warps} lengths {new}")


@pytest.mark.parametrize("route", ENGINE_ROUTES)
def test_one_plan_on_two_streams_and_two_threads(route):
    """Runs of one plan from two streams, and from two host threads each on its own stream, each
    with its own q and output, all match float64: the plan's partial states are never shared by
    two runs at once."""
    import torch

    engine = engine_of(SPEC, 4)
    batch, q, k, v = device_case(SPEC, [30000, 700, 9000], seed=4)
    plan = engine.plan(batch, route)
    qs = [q, torch.randn_like(q)]
    refs = [reference64(batch, x, k, v, 1 / math.sqrt(SPEC.head_dim))[0] for x in qs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [[torch.full_like(q, float("nan")) for _ in range(8)] for _ in qs]
    for i in range(8):  # alternate the two streams from one thread, with no ordering by the caller
        for j, s in enumerate(streams):
            with torch.cuda.stream(s):
                engine.run(qs[j], (k, v), plan, outs[j][i])
    torch.cuda.synchronize()
    for j in range(2):
        for o in outs[j]:
            assert_rows_close(o, refs[j], SPEC.dtype, f"{route} stream {j}")

    errors = []

    def worker(j):
        try:
            with torch.cuda.stream(streams[j]):
                for o in outs[j]:
                    o.fill_(float("nan"))
                    engine.run(qs[j], (k, v), plan, o)
        except Exception as exc:  # surfaced below: a thread's exception would be lost
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(j,)) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors, errors
    for j in range(2):
        for o in outs[j]:
            assert_rows_close(o, refs[j], SPEC.dtype, f"{route} thread {j}")


def test_engines_are_cached_per_device():
    import torch

    from persistentkv.engine import engine_for

    here = torch.cuda.current_device()
    engine = engine_for(SPEC)
    assert engine is engine_for(SPEC, device=here) and engine.device == torch.device("cuda", here)
    if torch.cuda.device_count() > 1:
        other = engine_for(SPEC, device=(here + 1) % torch.cuda.device_count())
        assert other is not engine and other.device.index == (here + 1) % torch.cuda.device_count()


def test_graph_replay_with_lse_matches():
    """A captured run with an LSE output writes it on every replay."""
    import torch

    engine = engine_of(SPEC, 8)
    batch, q, k, v = device_case(SPEC, [2, 3000, 80000], seed=8)
    plan = engine.plan(batch)
    out, lse = poisoned(q)
    engine.run(q, (k, v), plan, out, lse=lse)
    torch.cuda.synchronize()
    replay_captured(lambda: engine.run(q, (k, v), plan, out, lse=lse), [out, lse], replays=2)
    ref, ref_lse = reference64(batch, q, k, v, 1 / math.sqrt(SPEC.head_dim))
    assert_rows_close(out, ref, SPEC.dtype, "graph replay with lse")
    assert_lse_close(lse, ref_lse, "graph replay with lse")
