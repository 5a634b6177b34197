"""persistentkv: page-aware decode scheduling over a paged KV cache (planner, kernels, policy).

The library's import layers, ground first. A module imports only from layers below its own
(function-local imports too); the modules of one package share its layer and may import each
other, never in a circle. tests/test_layers.py holds every import to this table.

     1  errors names io                   -- user errors, the vocabulary, atomic files
     2  spec fp8 hardware analysis        -- the attention shape, e4m3 codes, the machine, timing statistics
     3  persistentkv env traces results   -- the package, what can run here, traces, the loader
     3  job_resources                     -- a job's GPU and CPUs (the workflow's job wrapper)
     4  configuration cache provenance    -- the config; the paged cache; what a run ran on
     5  plan                              -- the planner: split counts, work items, merge groups
     6  choose reference counters policy  -- the warps rule, the float64 oracle, counters, decisions
     7  launch calibration                -- the engine's compile and launch layer; policy fitting
     8  engine kernel_build ceiling       -- the GPU: the engine, its ahead-of-time build, the ceiling
     9  backends                          -- one adapter per kernel family, the registry, adaptive
    10  measure                           -- the timing harness: cases, protocols, rows, runs, step rounds
    11  model                             -- the Llama decode loop over any backend
    12  targets                           -- the engine's own targets, judged from rows
    13  targets_fp8                       -- the FP8 cache's targets, judged from the FP8 grids' rows
    14  claims reproduce reproduce_grid   -- the paper's claims, judged from rows; a rerun against them
    15  render                            -- figures, LaTeX tables and macros, the HTML report
    16  commands                          -- one module per CLI command
    17  cli                               -- the entry point
    18  __main__                          -- python -m persistentkv
"""

from .errors import PKVError
from .spec import AttentionSpec

__version__ = "0.1.0"
__all__ = ["AttentionSpec", "PKVError", "__version__"]
