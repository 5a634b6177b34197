"""The project's vocabulary, defined once: routes, backends, experiments, protocols, case names.

Every layer imports its names from here (and from nowhere else), so a route, a baseline or an
experiment is spelled in one place. Import-light: no third-party module, so the workflow rules
can read it while Snakemake builds the DAG.
"""

from __future__ import annotations

import re

#: Routes our engine runs (DecodeEngine.plan): the balanced work queue planned on the GPU with
#: its merge fused, exact-length buckets (one decode + merge pair each, as published), and the
#: rectangular B x Hkv x S grid with its empty splits (the published kernel's grid).
ENGINE_ROUTES = ("workqueue", "buckets", "split")
#: Routes the host planner knows (plan.make_plan): the engine's, plus padded buckets, which only
#: the bucket ablation counts (no kernel runs them).
PLAN_ROUTES = ("split", "buckets", "padded_buckets", "workqueue")

#: Our backends, in their stable order (results, tables, figures), and the engine route each runs.
PKV_BACKENDS = {"pkv-workqueue": "workqueue", "pkv-buckets": "buckets", "pkv-split": "split"}
#: FlashInfer's two decode kernels.
FLASHINFER = ("flashinfer-cc", "flashinfer-tc")
#: The baselines our routes are compared with; "best baseline" is the fastest of these per cell.
BASELINES = (*FLASHINFER, "vllm-fa3", "trtllm-xqa", "flashinfer-cudnn")
#: Named composite references, resolved per cell to the fastest member present.
COMPOSITE_REFERENCES = {"flashinfer-best": FLASHINFER, "baseline-best": BASELINES}
#: The frozen-policy backend that routes each step to one of the others.
ADAPTIVE = "adaptive"
#: Backends that run only on the host (never timed on a GPU).
CPU_ONLY = frozenset({"numpy"})
#: The one-kernel floor of a case: a plain read of exactly its K/V bytes in one kernel, cold L2,
#: graph-replayed (persistentkv.ceiling.OneKernelFloor), measured per case beside its backends.
FLOOR_BACKEND = "one-kernel-floor"
#: Pseudo-backends of bench_kernels.parquet (and bench_shapes.parquet) that are bandwidth probes,
#: not attention: never a baseline, never in the attention timing cells.
CEILING_BACKENDS = ("read-ceiling", "copy-ceiling", FLOOR_BACKEND)

#: Measurement experiments (persistentkv measure --experiment; results/<hw>/raw/<name>.parquet).
EXPERIMENTS = ("calibration", "published", "long_context", "fragmented", "batch_sweep", "gqa_sweep",
               "split_sensitivity")
#: Timing protocols of a raw row (docs/DATA.md): device time of run() in graph replay, one eager
#: call, a whole step (plan + L layers), and the paper's own window (plan inside, one layer).
PROTOCOLS = ("kernel", "eager", "step", "published")

#: The config traces of the paper's headline rows (docs/PAPER.md, Published numbers): the
#: ``published`` experiment measures them and claims C1-C5 judge them.
PUBLISHED_TRACES = ("bucketed_b1", "bimodal_b8", "uniform_b8", "zipf_b8", "bimodal_b4")
#: bench_kernels' grid (persistentkv bench-kernels): B rows of N tokens for every B and N here...
BENCH_BATCHES = (1, 2, 4, 8, 16, 64)
BENCH_LENGTHS = (1024, 4096, 8192, 16384, 32768, 131072)
#: ...plus these cases, by name (docs/DATA.md, bench_kernels).
BENCH_EXTRA = {
    "B1xN65536": [65536],
    "B1xN262144": [262144],
    "B4xN32768": [32768] * 4,
    # bimodal-like: every 4th row long (the published bimodal trace's shape), 130K tokens in all
    "B8-bimodal": [49152, 4096, 8192, 6144, 40960, 8192, 6144, 7168],
    # ragged: three long rows and five short ones (212K tokens)
    "B8-ragged": [65536, 65536, 65536, 4096, 4096, 4096, 4096, 4096],
}
#: The name :func:`synthetic_name` gives B rows of N tokens each: groups B and N.
EQUAL_ROWS = re.compile(r"^B(\d+)xN(\d+)$")


def synthetic_name(lengths) -> str:
    """The trace name of a synthetic case: ``B4xN8192`` for 4 rows of 8192 tokens (equal lengths,
    :data:`EQUAL_ROWS`); ``B8-ragged-216K`` style (rows, total tokens in K) otherwise."""
    lengths = [int(n) for n in lengths]
    if len(set(lengths)) == 1:
        return f"B{len(lengths)}xN{lengths[0]}"
    return f"B{len(lengths)}-ragged-{sum(lengths) // 1024}K"


#: The shapes experiment (persistentkv bench-shapes; results/<hw>/bench_shapes.parquet): the grid
#: is config measure.bench_shapes; its rows' experiment is this name.
SHAPES_EXPERIMENT = "bench_shapes"

#: The quantised KV-cache format: FP8 e4m3 (persistentkv.spec reads it as AttentionSpec.kv_dtype).
FP8_KV = "float8_e4m3"
#: Cache dtypes the kernel grids (bench-kernels, bench-shapes --kv-dtype; config measure.kv_dtypes)
#: measure besides the spec's own, and the suffix of their files: results/<hw>/bench_kernels_fp8.parquet.
KV_GRID_SUFFIX = {FP8_KV: "fp8"}
#: The kernel grids that are measured per cache dtype (results/<hw>/<grid>_<suffix>.parquet).
KV_GRIDS = ("bench_kernels", SHAPES_EXPERIMENT)
#: The experiments measured again on an FP8 cache (persistentkv measure --kv-dtype float8_e4m3, into
#: results/<hw>/raw_fp8/): the FP8 policy's fit (calibration) and its holdout judgement (the published
#: traces and the long-context rows, as the fp16 policy's).
FP8_EXPERIMENTS = ("calibration", "published", "long_context")


def kv_grid_name(grid: str, kv_dtype: str) -> str:
    """The file stem of ``grid`` (one of KV_GRIDS) measured on a ``kv_dtype`` cache:
    ``bench_kernels_fp8`` for float8_e4m3."""
    if grid not in KV_GRIDS or kv_dtype not in KV_GRID_SUFFIX:
        raise ValueError(f"no {kv_dtype!r} file of {grid!r}: grids {KV_GRIDS}, cache dtypes {tuple(KV_GRID_SUFFIX)}")
    return f"{grid}_{KV_GRID_SUFFIX[kv_dtype]}"
