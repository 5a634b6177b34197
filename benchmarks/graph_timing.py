"""Shared by the development benches: rotated cache copies, graph capture, interleaved replays."""

from __future__ import annotations

import numpy as np


def rotated_copies(spec, batch, l2_bytes: int, factor: float = 3.0, max_copies: int = 64, seed: int = 5):
    """(copies, q): R views of one KV tensor, R x case bytes >= factor x L2, and queries; fp16 normals."""
    import torch

    from persistentkv.measure.rotation import cold_copies

    R = min(max_copies, cold_copies(batch.kv_bytes, l2_bytes, factor))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = batch.num_pages
    shape = (R * pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    k_all = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float16)
    v_all = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float16)
    copies = [(k_all[r * pages:(r + 1) * pages], v_all[r * pages:(r + 1) * pages]) for r in range(R)]
    q = torch.randn((batch.batch_size, spec.num_qo_heads, spec.head_dim), generator=gen, device="cuda",
                    dtype=torch.float16)
    return copies, q


def capture(run, copies, calls: int, warmup: int = 3):
    """A CUDA graph of ``calls`` calls run(copy) cycling over ``copies`` (warmed up on a side stream)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for r in range(min(len(copies), warmup)):
            run(copies[r])
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(calls):
            run(copies[c % len(copies)])
    return graph


def time_replays(graphs: dict, repeats: int, calls: int, seed: int = 0) -> dict[str, list[float]]:
    """Microseconds per call of each graph: one warm-up replay each, then ``repeats`` rounds, each
    replaying every graph once in a shuffled order (CUDA events around each replay)."""
    import torch

    order = list(graphs)
    for name in order:
        graphs[name].replay()
    torch.cuda.synchronize()
    times = {name: [] for name in order}
    rng = np.random.default_rng(seed)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / calls)
    return times
