"""The timing harness (docs/PROTOCOL.md): fair protocols, the published one, raw rows.

Everything that is not a CUDA call is pure and CPU-tested:

    workload    cases from trace steps or synthetic lengths; the experiment grids from the config
    rotation    cold-L2 copy counts, the copy cursor and graph offsets
    schedule    the interleaved round order (shuffled per round, or rotated); warm-up rounds
    statistics  per-call times, GB/s, fraction of the read ceiling, medians for the printed table
    rows        the raw-row schema of docs/DATA.md (columns, dtypes, unavailable/failed rows)

and the device-facing parts are thin:

    device      torch on CUDA (events, graphs: capture_graph, every graph's capture) or on the CPU
                (host clocks; used by the tests)
    protocols   kernel / eager / step / published timing of one backend on one case
    harness     one case: caches, plans, warm-up, interleaved rounds, per-backend error capture
    validation  every backend against the float64 reference (validate-gpu) and the smoke check
    steps       whole decode steps (measure-e2e, benchmarks/step_probe.py): the attention-alone
                graphs over a decode loop's pieces, rotated rounds of graphs behind a GPU spin
"""
