"""How fast can one kernel call stream a decode step's bytes? Read patterns against our queue.

    python benchmarks/bench_stream.py [--out DIR] [--repeats 15] [--calls 10] [--sizes-mb 16.8,134]

NOTES v9 found the 8-warp queue within ~1.5 us of the plain read (kernels/ceiling.cu) of the same
bytes at 134 MB, and that plain read slower than the engine issue's mid-range target. But that
read ran without programmatic dependent launch (PDL), which the queue uses, and it is one
pattern among several. This bench times, in CUDA graphs of --calls calls over rotated cold
buffers (as bench_common.PlainRead), every pattern of benchmarks/stream_patterns.cu at each size,
interleaved with the 8-warp queue at B=1 over the same number of KV bytes:

  grid            ceiling.cu's pattern (8 x 256-thread CTAs per SM), no PDL: bench_warps' `read`
  grid-pdl        the same with PDL
  chunk8-{1,2}    a contiguous chunk per CTA, 8 loads of 16 B in flight per thread, 1 CTA of 1024
                  threads / 2 of 512 per SM (128 KB in flight per SM), PDL
  chunk8-l2-1     chunk8-1 with ld.global.nc.L1::no_allocate.L2::256B
  bulk-SxK-n      cp.async.bulk into S shared buffers of K KB per CTA, n CTAs per SM, PDL
  wq8             pkv-workqueue's 8-warp queue, B=1 at N = bytes / 4 KB tokens (Hq 32, Hkv 8, D 128,
                  fp16, page 16; its bytes are N x 4 KB), PDL

--paged (B=1 rows of the same sizes over a paged cache [pages, 16, 8, 128] fp16, pages scattered by
a random block table; a page's K, or V, for all kv heads is one contiguous 32 KB slab):
  pages-bulk-n    one cp.async.bulk per slab into 32 KB shared buffers (6 per CTA at n = 1 CTA/SM,
                  3 at n = 2), a contiguous range of the row's pages per CTA, PDL
  pages-tma-n     the same with two 16 KB tensor-map boxes per slab, the map's dims ordered (dim,
                  token, head, page) so a box lands as [head][token][64 dims] with the 128-byte
                  swizzle: the layout a kernel that owns all kv heads of its tokens would read
  pages-loads-1   per-thread 16-byte loads over the slabs, 8 in flight, 1024 threads, 1 CTA/SM
  pages-hK[s]     the same loads, but a CTA reads only K kv heads of each token row (K x 256 B
                  pieces, 2 KB apart): 8 / K head groups x 16 x K page ranges, 128 CTAs; the queue's
                  items read K = 1. "s": consecutive CTAs take the page ranges of one head group (the
                  queue's item order), else the head groups of one page range
  wq8, wq8-tma    the 8-warp queue (cp.async; PKV_TMA=1) over the same cache and block table
Each read variant is first checked: the XOR of every 32-bit word it folds must equal the
buffer's (so it read each word an odd number of times: once). The table gives us per call,
GB/s and the fraction of the read ceiling measured at 1 GB in this run; writes
bench_stream_HHMMSS.parquet to --out ($OUT).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

from graph_timing import capture, rotated_copies, time_replays  # noqa: E402

SIZES_MB = (16.78, 33.55, 67.11, 134.2, 268.4, 536.9)  # B=1 at 4K, 8K, 16K, 32K, 64K, 128K tokens
KV_BYTES_PER_TOKEN = 2 * 8 * 128 * 2                     # K and V, Hkv 8, D 128, fp16


def args_() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--sizes-mb", default=",".join(str(s) for s in SIZES_MB))
    p.add_argument("--paged", action="store_true", help="the paged variants instead of the flat ones")
    return p.parse_args()


class Launcher:
    """cuLaunchKernelEx of one function with a fixed shape (PDL attribute when pdl); parameter
    blocks bound per key (a cache copy), kept alive here."""

    def __init__(self, function, grid, threads, smem, pdl):
        from persistentkv import engine as eng

        self.function, self.grid, self.threads, self.smem, self.pdl = function, grid, threads, smem, pdl
        self.launch_ex = eng._launch_kernel_ex()
        self.attr = eng._LaunchAttribute(id=eng.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        self.attr.value[0] = 1
        self.blocks = {}

    def bind(self, key, values: list):
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        self.blocks[key] = (values, params)

    def launch(self, key, stream: int):
        from persistentkv import engine as eng

        cfg = eng._LaunchConfig(self.grid, 1, 1, self.threads, 1, 1, self.smem, stream,
                                ctypes.pointer(self.attr) if self.pdl else None, 1 if self.pdl else 0)
        status = self.launch_ex(ctypes.byref(cfg), ctypes.c_void_p(self.function), self.blocks[key][1], None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernelEx returned {status}")


class Read(Launcher):
    """A flat read pattern over rotated buffers: parameters (src, n, sink, pdl, *extra ints)."""

    def __init__(self, function, grid, threads, smem, pdl, extra=()):
        super().__init__(function, grid, threads, smem, pdl)
        self.extra = extra

    def bind_buffer(self, src_ptr: int, n: int, sink_ptr: int):
        """The parameter block for one buffer, keyed by its pointer."""
        self.bind(src_ptr, [ctypes.c_void_p(src_ptr), ctypes.c_uint64(n), ctypes.c_void_p(sink_ptr),
                            ctypes.c_int(int(self.pdl)), *(ctypes.c_int(v) for v in self.extra)])


def checked_graph(name: str, launcher: Launcher, items: list, sink, expect: int, calls: int, what: str):
    """Launch once over ``items[0]`` (parameter blocks keyed by ``item[0].data_ptr()``), check that
    the sink's XOR equals ``expect`` (every word read once), then capture a graph of ``calls``
    launches cycling over ``items``. None, with the reason printed, when the XOR is wrong."""
    import torch

    sink.zero_()
    launcher.launch(items[0][0].data_ptr(), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    got = int(sink.item()) & 0xFFFFFFFF
    if got != expect:
        print(f"  {name}: XOR {got:#010x} != {what} {expect:#010x}: WRONG, left out")
        return None
    return capture(lambda kv: launcher.launch(kv[0].data_ptr(), torch.cuda.current_stream().cuda_stream),
                   items, calls)


def time_size(graphs: dict, args, rows: list, table: list, nbytes: int, tokens: int, floor: float, ceiling: float,
              **extra) -> None:
    """Replay ``graphs`` interleaved; add one row per (variant, repeat) and the size's medians."""
    times = time_replays(graphs, args.repeats, args.calls)
    for name, ts in times.items():
        rows += [{"mb": nbytes / 1e6, "tokens": tokens, "variant": name, "repeat": i, "time_us": t,
                  "floor_us": floor, "read_ceiling_gbps": ceiling, **extra} for i, t in enumerate(ts)]
    table.append((nbytes, floor, {name: statistics.median(ts) for name, ts in times.items()}))
    graphs.clear()


def slab_map(ptr: int, num_pages: int):
    """A (dim 128, token 16, head 8, page) map of one fp16 cache, box 64 x 16 x 8 x 1, 128-byte
    swizzle (the strides are given out of order on purpose: token 2 KB, head 256 B)."""
    from persistentkv import engine as eng

    fn = eng._encode_tiled()
    raw = ctypes.create_string_buffer(256)
    at = (ctypes.addressof(raw) + 127) & ~127
    dims = (ctypes.c_uint64 * 4)(128, 16, 8, num_pages)
    strides = (ctypes.c_uint64 * 3)(2048, 256, 32768)
    box = (ctypes.c_uint32 * 4)(64, 16, 8, 1)
    ones = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    status = fn(at, 6, 4, ptr, dims, strides, box, ones, 0, 3, 3, 0)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled refused the slab map (CUresult {status})")
    return (ctypes.c_uint64 * 16).from_buffer_copy(ctypes.string_at(at, 128))


def main_paged(args, module_fn, sms: int, l2: int, ceiling: float, t_start: float) -> int:
    import numpy as np
    import torch

    from bench_common import first_line, write_rows
    from persistentkv import engine as eng
    from persistentkv.cache import Batch
    from persistentkv.engine import engine_for
    from persistentkv.measure.rotation import cold_copies
    from persistentkv.spec import AttentionSpec

    slab = 32768
    variants = {}
    for name, fn, per_sm, stages in (("pages-bulk-1", "st_pages_bulk", 1, 6), ("pages-bulk-2", "st_pages_bulk", 2, 3),
                                     ("pages-tma-1", "st_pages_tma", 1, 6), ("pages-tma-2", "st_pages_tma", 2, 3)):
        variants[name] = (Launcher(module_fn[fn].ptr, sms * per_sm, 256, stages * slab + 1024, True), stages)
    variants["pages-loads-1"] = (Launcher(module_fn["st_pages_loads"].ptr, sms, 1024, 0, True), None)
    # K kv heads per CTA (pkv_decode's items: 1), 128 CTAs of 1024 threads; "s": the queue's order
    # (consecutive CTAs take page ranges of one head group), else the head groups of one range
    for k in (1, 2, 4, 8):
        for order, head_fast in (("", 1), ("s", 0)):
            if k < 8 or head_fast:
                variants[f"pages-h{k}{order}"] = (Launcher(module_fn[f"st_pages_h{k}"].ptr, 128, 1024, 0, True),
                                                  ("heads", head_fast))
    for fn in ("st_pages_bulk", "st_pages_tma"):
        eng._set_function_attribute(module_fn[fn].ptr, eng.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    6 * slab + 1024)
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engines = {"wq8": engine_for(spec, warps=8), "wq8-tma": engine_for(spec, warps=8, defines=("PKV_TMA=1",))}
    rows, table = [], []
    for mb in (float(x) for x in args.sizes_mb.split(",")):
        npages = max(1, int(round(mb * 1e6 / (2 * slab))))
        tokens = npages * 16
        kv_bytes = 2 * npages * slab
        count = max(2, min(64, cold_copies(kv_bytes, l2, 3.0)))
        gen = torch.Generator(device="cuda").manual_seed(npages)
        caches = [(torch.randn((npages, 16, 8, 128), generator=gen, device="cuda", dtype=torch.float16),
                   torch.randn((npages, 16, 8, 128), generator=gen, device="cuda", dtype=torch.float16))
                  for _ in range(count)]
        perm = np.random.default_rng(npages).permutation(npages).astype(np.int32)
        table_dev = torch.from_numpy(perm).cuda()
        k0, v0 = caches[0]
        expect = int(np.bitwise_xor.reduce(k0.view(torch.int32).cpu().numpy().ravel().view(np.uint32))
                     ^ np.bitwise_xor.reduce(v0.view(torch.int32).cpu().numpy().ravel().view(np.uint32)))
        sinks = torch.zeros(len(variants), dtype=torch.int32, device="cuda")
        floor = kv_bytes / (ceiling * 1e3)
        print(f"{kv_bytes / 1e6:.1f} MB (B=1 x {tokens} tokens, {npages} scattered pages): floor {floor:.2f} us, "
              f"{count} caches", flush=True)
        graphs = {}
        for vi, (name, (launcher, stages)) in enumerate(variants.items()):
            sink = sinks[vi:vi + 1]
            try:
                for kc, vc in caches:
                    values = [ctypes.c_void_p(kc.data_ptr()), ctypes.c_void_p(vc.data_ptr()),
                              ctypes.c_void_p(table_dev.data_ptr()), ctypes.c_int(npages),
                              ctypes.c_void_p(sink.data_ptr()), ctypes.c_int(1)]
                    if isinstance(stages, tuple):  # ("heads", head_fast)
                        values.append(ctypes.c_int(stages[1]))
                    elif stages is not None:
                        values.append(ctypes.c_int(stages))
                    if name.startswith("pages-tma"):
                        values += [slab_map(kc.data_ptr(), npages), slab_map(vc.data_ptr(), npages)]
                    launcher.bind(kc.data_ptr(), values)
                graph = checked_graph(name, launcher, caches, sink, expect, args.calls, "the cache's")
                if graph is not None:
                    graphs[name] = graph
            except Exception as exc:
                print(f"  {name}: failed ({first_line(exc)})")
                torch.cuda.synchronize()
        batch = Batch(spec, np.array([tokens], dtype=np.int32), np.array([0, npages], dtype=np.int32), perm, npages)
        q = torch.randn((1, 32, 128), generator=gen, device="cuda", dtype=torch.float16)
        out = torch.empty_like(q)
        for name, e in engines.items():
            try:
                plan = e.plan(batch, "workqueue")
                graphs[name] = capture(lambda kv, e=e, plan=plan: e.run(q, kv, plan, out), caches, args.calls)
            except Exception as exc:
                print(f"  {name}: failed ({first_line(exc)})")
        time_size(graphs, args, rows, table, kv_bytes, tokens, floor, ceiling, paged=True)
        del caches
        torch.cuda.empty_cache()
        write_rows(rows, args.out, "bench_stream_paged", t_start, final=False)  # each size as it is done
    print_table(table)
    write_rows(rows, args.out, "bench_stream_paged", t_start)
    return 0


def print_table(table) -> None:
    names = list(dict.fromkeys(n for *_, med in table for n in med))
    print("\nus per call (median of --repeats graph replays), and % of the 1 GB read ceiling")
    print(f"{'MB':>7} {'floor':>6}  " + "  ".join(f"{n:>13}" for n in names))
    for nbytes, floor, med in table:
        print(f"{nbytes / 1e6:7.1f} {floor:6.2f}  " + "  ".join(
            f"{med[n]:6.1f} ({100 * floor / med[n]:3.0f}%)" if n in med else f"{'-':>13}" for n in names))


def main() -> int:
    import cupy
    import numpy as np
    import torch

    from bench_common import first_line, read_ceiling_gbps, write_rows
    from persistentkv import engine as eng
    from persistentkv.cache import make_batch
    from persistentkv.engine import engine_for
    from persistentkv.measure.rotation import cold_copies
    from persistentkv.spec import AttentionSpec

    args = args_()
    t_start = time.time()
    props = torch.cuda.get_device_properties(0)
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    with cupy.cuda.Device(0):
        module = cupy.RawModule(code=(ROOT / "benchmarks" / "stream_patterns.cu").read_text(),
                                options=("-std=c++17",))
        fn = {name: module.get_function(name).kernel for name in
              ("st_grid", "st_chunk8", "st_chunk8_l2", "st_bulk", "st_pages_bulk", "st_pages_tma", "st_pages_loads",
               "st_pages_h1", "st_pages_h2", "st_pages_h4", "st_pages_h8")}
    bulk_smem_max = 0
    variants = {
        "grid": Read(fn["st_grid"].ptr, sms * 8, 256, 0, False),
        "grid-pdl": Read(fn["st_grid"].ptr, sms * 8, 256, 0, True),
        "chunk8-1": Read(fn["st_chunk8"].ptr, sms, 1024, 0, True),
        "chunk8-2": Read(fn["st_chunk8"].ptr, sms * 2, 512, 0, True),
        "chunk8-l2-1": Read(fn["st_chunk8_l2"].ptr, sms, 1024, 0, True),
    }
    for stages, kb, per_sm in ((6, 32, 1), (4, 48, 1), (12, 16, 1), (3, 32, 2), (6, 16, 2)):
        smem = stages * kb * 1024
        bulk_smem_max = max(bulk_smem_max, smem)
        variants[f"bulk-{stages}x{kb}-{per_sm}"] = Read(fn["st_bulk"].ptr, sms * per_sm, 256, smem, True,
                                                        (stages, kb * 1024))
    eng._set_function_attribute(fn["st_bulk"].ptr, eng.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bulk_smem_max)
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    wq8 = engine_for(spec, warps=8)
    ceiling = read_ceiling_gbps()
    print(f"{props.name}: {sms} SMs, L2 {l2 / 2**20:.0f} MiB, read ceiling {ceiling:.0f} GB/s (1 GB, ceiling.cu)")
    if args.paged:
        return main_paged(args, fn, sms, l2, ceiling, t_start)
    rows, table = [], []
    for mb in (float(s) for s in args.sizes_mb.split(",")):
        tokens = max(16, int(round(mb * 1e6 / KV_BYTES_PER_TOKEN / 16)) * 16)
        nbytes = tokens * KV_BYTES_PER_TOKEN
        count = max(2, min(64, cold_copies(nbytes, l2, 3.0)))
        gen = torch.Generator(device="cuda").manual_seed(int(mb * 100))
        bufs = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda", generator=gen)
                for _ in range(count)]
        expect = int(np.bitwise_xor.reduce(bufs[0].cpu().numpy().view(np.uint32)))
        sinks = torch.zeros(len(variants), dtype=torch.int32, device="cuda")
        floor = nbytes / (ceiling * 1e3)
        print(f"{nbytes / 1e6:.1f} MB (B=1 x {tokens} tokens): floor {floor:.2f} us at the 1 GB ceiling, {count} buffers",
              flush=True)
        graphs = {}
        for vi, (name, read) in enumerate(variants.items()):
            sink = sinks[vi:vi + 1]
            n = nbytes if name.startswith("bulk") else nbytes // 16
            for b in bufs:
                read.bind_buffer(b.data_ptr(), n, sink.data_ptr())
            try:
                graph = checked_graph(name, read, [(b, None) for b in bufs], sink, expect, args.calls, "buffer's")
                if graph is not None:
                    graphs[name] = graph
            except Exception as exc:
                print(f"  {name}: failed ({first_line(exc)})")
                torch.cuda.synchronize()
        copies = None
        try:
            batch = make_batch(spec, [tokens], seed=1)
            copies, q = rotated_copies(spec, batch, l2)
            plan = wq8.plan(batch, "workqueue")
            out = torch.empty_like(q)
            graphs["wq8"] = capture(lambda kv: wq8.run(q, kv, plan, out), copies, args.calls)
        except Exception as exc:
            print(f"  wq8: failed ({first_line(exc)})")
        time_size(graphs, args, rows, table, nbytes, tokens, floor, ceiling, gpu=props.name)
        del bufs, copies
        torch.cuda.empty_cache()
        write_rows(rows, args.out, "bench_stream", t_start, final=False)  # each size as it is done
    print_table(table)
    write_rows(rows, args.out, "bench_stream", t_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
