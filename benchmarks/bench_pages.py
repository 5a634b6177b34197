"""The v11 prototype (benchmarks/pages_decode.cu: a CTA over all kv heads of a page range, fed by
whole-page bulk copies) against the shipped kernel and the baselines, under graph replay.

    python benchmarks/bench_pages.py [--out DIR] [--cases B=1x4096,B=4x8192] [--repeats 15]

Same cases, harness and table as bench_warps.py (bench_common.py): every variant checked against
float64, then CUDA graphs over rotated cold copies, all interleaved:
  wq, wq8            the GPU-planned queue, 4 and 8 warps (the shipped kernel, early_kv on)
  pages4, pages5     the prototype with a ring of 4 or 5 slab buffers (32 KB each) per CTA,
                     then its merge kernel; both launched with programmatic dependent launch
  pages4f, pages5f   the same with the merge inside the decode grid (a grid-wide arrival counter;
                     refused where the items exceed one wave)
  flashinfer-tc, vllm-fa3, trtllm-xqa   the baselines, where they run here
  read               the read-ceiling kernel over the case's bytes (not attention)
  read-pages4-decode (--split-time) pages4's decode kernel alone, no merge (not attention)
Prototype limits: fp16, head_dim 128, Hkv 8, page 16, G <= 8, contiguous caches. Writes
bench_pages_HHMMSS.parquet to --out ($OUT). Outcomes on the H200: benchmarks/NOTES.md v13 and v14
(neither merge makes the prototype faster than the shipped queue; not adopted).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_common import (add_baselines, add_plain_read, add_queue, bench_args, comparison_row,  # noqa: E402
                          first_line, load_baselines, planning_adder, print_comparison, read_ceiling_gbps,
                          timed_cases, write_rows)
from persistentkv.errors import require  # noqa: E402
from persistentkv.spec import AttentionSpec  # noqa: E402

SLAB = 16 * 8 * 128 * 2          # one page's K (or V) for all kv heads, bytes
PRIVATE = 8 * 2 * 16 * 128 * 2   # the 8 warps' K and V tiles


def split_pages(seq_lens, page_size: int, ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """(items [n, 4] int32 = (row, first page, end page, 0), item_indptr [B + 1]): row r's pages cut
    into max(1, floor(ctas x its share of all pages)) near-equal ranges, so that the items fill one
    wave of ``ctas`` CTAs (more only where rows with under one CTA's share each take one)."""
    pages = [(int(n) + page_size - 1) // page_size for n in seq_lens]
    total = sum(pages)
    items, indptr = [], [0]
    for row, n in enumerate(pages):
        parts = min(n, max(1, ctas * n // total))
        bounds = [n * j // parts for j in range(parts + 1)]
        items += [(row, bounds[j], bounds[j + 1], 0) for j in range(parts)]
        indptr.append(len(items))
    return np.asarray(items, dtype=np.int32).reshape(-1, 4), np.asarray(indptr, dtype=np.int32)


class Pages:
    """The prototype's plan and launches for one batch: run(q, (k, v), out)."""

    def __init__(self, module: dict, ns: int, batch, sms: int, merge: bool = True, fused: bool = False):
        import torch

        from persistentkv import engine as eng

        spec = batch.spec
        require(spec.dtype == "float16" and spec.head_dim == 128 and spec.num_kv_heads == 8 and spec.page_size == 16
                and spec.group_size <= 8, "the prototype takes fp16, head_dim 128, Hkv 8, page 16, G <= 8")
        items, indptr = split_pages(batch.seq_lens, spec.page_size, sms)
        dev = torch.device("cuda")
        self.t = {name: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(dev) for name, a in
                  (("items", items), ("item_indptr", indptr), ("seq_lens", batch.seq_lens),
                   ("kv_indptr", batch.kv_indptr), ("kv_indices", batch.kv_indices))}
        n, G = len(items), spec.group_size
        # The fused merge waits for every CTA of the grid: all of them must be resident at once.
        require(not fused or n <= sms, f"the fused prototype needs one wave: {n} items > {sms} SMs")
        self.fused = fused
        self.counters = torch.zeros(2, dtype=torch.int32, device=dev)
        self.part_o = torch.empty(n * 8 * G * 128, dtype=torch.float32, device=dev)
        self.part_lse = torch.empty(n * 8 * G, dtype=torch.float32, device=dev)
        self.num_items = n
        #: False (diagnosis only): run() launches the decode kernel alone, leaving `out` unwritten
        self.merge = merge
        P, I32, F32 = eng._PTR, eng._I32, eng._F32
        dec = eng._arg_layout("PagesArgs", [("q", P), ("k", P), ("v", P), ("kv_indices", P), ("kv_indptr", P),
                                            ("seq_lens", P), ("items", P), ("part_o", P), ("part_lse", P),
                                            ("G", I32), ("scale_log2", F32), ("early", I32), ("item_indptr", P),
                                            ("out", P), ("counters", P), ("units", I32)])
        mrg = eng._arg_layout("PagesMergeArgs", [("part_o", P), ("part_lse", P), ("item_indptr", P), ("out", P),
                                                 ("G", I32)])
        scale_log2 = float(np.float32(math.log2(math.e) / math.sqrt(spec.head_dim)))
        # early = 3: the items (uploaded and synchronised above, before any run) and the first
        # slabs of every page but each item's last are read before griddepcontrol.wait.
        self.dec = eng._arg_block(dec, 0, 0, 0, self.t["kv_indices"].data_ptr(), self.t["kv_indptr"].data_ptr(),
                                  self.t["seq_lens"].data_ptr(), self.t["items"].data_ptr(), self.part_o.data_ptr(),
                                  self.part_lse.data_ptr(), G, scale_log2, 3, self.t["item_indptr"].data_ptr(), 0,
                                  self.counters.data_ptr(), batch.batch_size * spec.num_qo_heads * 4)
        self.mrg = eng._arg_block(mrg, self.part_o.data_ptr(), self.part_lse.data_ptr(),
                                  self.t["item_indptr"].data_ptr(), 0, G)
        smem = ns * SLAB + PRIVATE
        fn = module[f"pg_decode_fused{ns}" if fused else f"pg_decode{ns}"]
        eng._set_function_attribute(fn, eng.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        self.launch_dec = eng._PDLLaunch(fn, n, 256, smem, self.dec.address)
        self.launch_mrg = eng._PDLLaunch(module["pg_merge"], batch.batch_size * spec.num_qo_heads, 1024, 0,
                                         self.mrg.address)
        torch.cuda.synchronize()

    def run(self, q, kv, out) -> None:
        import torch

        k, v = kv
        require(k.is_contiguous() and v.is_contiguous() and q.is_contiguous() and out.is_contiguous(),
                "the prototype takes contiguous q, out and caches")
        self.dec.q, self.dec.k, self.dec.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
        self.dec.out = self.mrg.out = out.data_ptr()
        stream = torch.cuda.current_stream().cuda_stream
        self.launch_dec(stream)
        if self.merge and not self.fused:
            self.launch_mrg(stream)


def load_module() -> dict:
    import cupy

    module = cupy.RawModule(code=(ROOT / "benchmarks" / "pages_decode.cu").read_text(),
                            options=("-std=c++17", "--use_fast_math"))
    return {name: module.get_function(name).kernel.ptr for name in
            ("pg_decode4", "pg_decode5", "pg_decode_fused4", "pg_decode_fused5", "pg_merge")}


def main() -> int:
    import torch

    from persistentkv.engine import engine_for

    def extra(parser):
        parser.add_argument("--split-time", action="store_true", help="also time pages4's decode kernel without its merge")
        parser.add_argument("--only", default="", help="comma-separated variant names to keep (default all)")

    args = bench_args(extra)
    only = {n.strip() for n in args.only.split(",") if n.strip()}
    t_start = time.time()
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    engines = {"wq": engine_for(spec), "wq8": engine_for(spec, warps=8)}
    module = load_module()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ceiling = read_ceiling_gbps()
    print(f"{torch.cuda.get_device_name(0)}: read ceiling {ceiling:.0f} GB/s, {sms} SMs")
    baselines = load_baselines(spec)

    def variants_for(batch):
        runs = {}
        add = planning_adder(runs)
        for name, engine in engines.items():
            add_queue(add, batch, name, engine)
        for ns in (4, 5):
            add(f"pages{ns}", lambda ns=ns: Pages(module, ns, batch, sms),
                lambda q: (lambda kv, p, o: p.run(q, kv, o)))
            add(f"pages{ns}f", lambda ns=ns: Pages(module, ns, batch, sms, fused=True),
                lambda q: (lambda kv, p, o: p.run(q, kv, o)))
        if args.split_time:  # the decode kernel alone (its output is not attention: not checked)
            add("read-pages4-decode", lambda: Pages(module, 4, batch, sms, merge=False),
                lambda q: (lambda kv, p, o: p.run(q, kv, o)))
        add_baselines(add, batch, baselines)
        add_plain_read(add, batch)
        return {n: r for n, r in runs.items() if not only or n in only}

    rows, table = [], []
    for label, batch, med, ok, floor in timed_cases(engines["wq"], spec, args, variants_for, ceiling, rows,
                                                    "bench_pages", t_start):
        table.append(comparison_row(label, floor, med, ok, lambda n: n.startswith("pages")))
    print_comparison(table, "pages")
    write_rows(rows, args.out, "bench_pages", t_start)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except Exception as exc:  # a one-line reason, not a traceback from deep inside
        print(f"bench_pages: {first_line(exc)}", file=sys.stderr)
        raise SystemExit(1)
