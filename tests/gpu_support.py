"""Helpers shared by the GPU tests: skip reasons, device caches, an independent float64 reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from persistentkv.cache import Batch, make_batch
from persistentkv.reference import TOLERANCE, gate_errors  # noqa: F401 (TOLERANCE: the tests' one table)
from persistentkv.spec import AttentionSpec


def gpu_skip_reason() -> str | None:
    from persistentkv.engine import gpu_reasons

    reasons = gpu_reasons()
    return "; ".join(reasons) if reasons else None


requires_gpu = pytest.mark.skipif(gpu_skip_reason() is not None, reason=f"needs a CUDA GPU: {gpu_skip_reason()}")


def torch_dtype(name: str):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


#: The K/V cache layouts of the GPU correctness matrix (kv_layout).
LAYOUTS = ("contiguous", "kv_interleaved")


def kv_layout(k, v, layout: str):
    """(K, V) holding ``k``'s and ``v``'s values in ``layout``: "contiguous" returns them as they
    are; "kv_interleaved" copies them into one [num_pages, 2, P, Hkv, D] buffer and returns the
    views K = buf[:, 0], V = buf[:, 1] (vLLM's layout of a layer's cache), whose strides are
    [2*P*Hkv*D, Hkv*D, D, 1]: not contiguous, the page stride twice a page."""
    import torch

    if layout == "contiguous":
        return k, v
    assert layout == "kv_interleaved", f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}"
    buf = torch.stack((k, v), dim=1)
    kk, vv = buf[:, 0], buf[:, 1]
    pages, P, H, D = k.shape
    assert kk.stride() == vv.stride() == (2 * P * H * D, H * D, D, 1)
    return kk, vv


def device_case(spec: AttentionSpec, lengths, hole_fraction: float = 0.25, seed: int = 0,
                layout: str = "contiguous"):
    """(batch, q, k_cache, v_cache) on the GPU with standard-normal values; fresh per seed; the
    caches in ``layout`` (kv_layout: the same values either way)."""
    import torch

    batch = make_batch(spec, lengths, hole_fraction=hole_fraction, seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    dt = torch_dtype(spec.dtype)
    shape = (batch.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    k = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dt)
    v = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dt)
    q = torch.randn((batch.batch_size, spec.num_qo_heads, spec.head_dim), generator=gen, device="cuda",
                    dtype=torch.float32).to(dt)
    k, v = kv_layout(k, v, layout)
    return batch, q, k, v


def reference_torch64(batch: Batch, q, k, v):
    """Dense float64 attention on the GPU, row by row and kv head by kv head (never uses a plan)."""
    import torch

    spec = batch.spec
    G, D = spec.group_size, spec.head_dim
    out = torch.empty((batch.batch_size, spec.num_qo_heads, D), dtype=torch.float64, device="cuda")
    indptr = batch.kv_indptr
    indices = torch.from_numpy(batch.kv_indices.astype(np.int64)).cuda()
    scale = 1.0 / math.sqrt(D)
    for i in range(batch.batch_size):
        n = int(batch.seq_lens[i])
        pages = indices[int(indptr[i]):int(indptr[i + 1])]
        for h in range(spec.num_kv_heads):
            kh = k[pages, :, h, :].reshape(-1, D)[:n].double()
            vh = v[pages, :, h, :].reshape(-1, D)[:n].double()
            qh = q[i, h * G:(h + 1) * G].double()
            p = torch.softmax((qh @ kh.T) * scale, dim=-1)
            out[i, h * G:(h + 1) * G] = p @ vh
    return out


def row_head_errors_torch(out, ref):
    """float64 [B, Hq] on ``ref``'s device: ||out[b, h] - ref[b, h]|| / max(||ref[b, h]||, TINY_NORM),
    inf where ``out`` holds NaN or inf in that (row, head) (reference.row_head_errors in torch:
    the norms reduce on the GPU, only [B, Hq] comes back)."""
    import torch

    from persistentkv.reference import TINY_NORM

    o = out.to(device=ref.device, dtype=torch.float64)
    finite = torch.isfinite(o).all(dim=-1)
    diff = torch.linalg.vector_norm(torch.where(torch.isfinite(o), o, 0.0) - ref, dim=-1)
    err = diff / torch.linalg.vector_norm(ref, dim=-1).clamp_min(TINY_NORM)
    return torch.where(finite, err, torch.full_like(err, math.inf))


def assert_rows_close(out, ref, dtype_or_tol, what: str = "", *, seq_lens=None) -> float:
    """``out`` [B, Hq, D] (any float dtype) against the float64 ``ref`` per (row, query head):
    every ||out[b, h] - ref[b, h]|| / ||ref[b, h]|| within the tolerance (TOLERANCE[dtype] for a
    dtype name, else the number). Fails with one line naming the worst (row, head), its error and
    the tolerance (and the row's length when ``seq_lens`` is given); returns the worst error."""
    import torch

    assert ref.dtype == torch.float64, f"the reference must be float64, got {ref.dtype}"
    assert tuple(out.shape) == tuple(ref.shape) and out.dim() == 3, \
        f"out {tuple(out.shape)} and ref {tuple(ref.shape)} must both be [B, Hq, D]"
    verdict = gate_errors(row_head_errors_torch(out, ref).cpu().numpy(), dtype_or_tol, seq_lens)
    assert verdict.passed, f"{what}: {verdict.describe()}" if what else verdict.describe()
    return verdict.max_err


def assert_graph_replay_matches(engine, plan, batch, q, k, v, tolerance: float, calls: int = 4, replays: int = 3):
    """One eager run, then ``calls`` runs of ``plan`` cycling over two copies of the cache captured
    in one CUDA graph; the outputs are poisoned with NaN and the graph replayed ``replays`` times:
    every output must match the float64 reference again (nothing in the plan is used up by a run)."""
    import torch

    ks, vs = [k, k.clone()], [v, v.clone()]
    ref = reference_torch64(batch, q, k, v)
    outs = [torch.full_like(q, float("nan")) for _ in range(calls)]
    engine.run(q, (k, v), plan, outs[0])
    torch.cuda.synchronize()

    def calls():
        for i, o in enumerate(outs):
            engine.run(q, (ks[i % 2], vs[i % 2]), plan, o)

    replay_captured(calls, outs, replays)
    for i, o in enumerate(outs):
        assert_rows_close(o, ref, tolerance, f"graph replay, call {i}", seq_lens=batch.seq_lens)


def replay_captured(step, outs, replays: int = 1) -> None:
    """Capture ``step()`` in one CUDA graph, poison ``outs`` with NaN, replay the graph ``replays``
    times and synchronise: what ``outs`` then hold, the replays wrote."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for o in outs:
        o.fill_(float("nan"))
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()


def run_step(step, outs, graph: bool, replays: int = 3) -> None:
    """``step()`` once, eagerly, or (``graph``) warmed up on a side stream, then captured in one
    CUDA graph and replayed (replay_captured); synchronised either way."""
    import torch

    if not graph:
        step()
        torch.cuda.synchronize()
        return
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    replay_captured(step, outs, replays)


def assert_repeats_bit_exact(engine, plan, q, k, v, out, times: int = 5):
    """``times`` more runs of ``plan`` write exactly ``out`` again (counters reset, same merge order)."""
    import torch

    for _ in range(times):
        again = torch.full_like(q, float("nan"))
        engine.run(q, (k, v), plan, again)
        torch.testing.assert_close(again, out, rtol=0, atol=0)
