"""The timing harness (docs/PROTOCOL.md): fair protocols, the published one, raw rows.

Everything that is not a CUDA call is pure and CPU-tested:

    workload    cases from trace steps or synthetic lengths; the experiment grids from the config
    rotation    cold-L2 copy counts, the copy cursor and graph offsets
    schedule    the interleaved, per-round shuffled backend order; warm-up rounds
    statistics  per-call times, GB/s, fraction of the read ceiling, medians for the printed table
    rows        the raw-row schema of docs/DATA.md (columns, dtypes, unavailable/failed rows)

and the device-facing parts are thin:

    device      torch on CUDA (events, graphs) or on the CPU (host clocks; used by the tests)
    protocols   kernel / eager / step / published timing of one backend on one case
    harness     one case: caches, plans, warm-up, interleaved rounds, per-backend error capture
    validation  every backend against the float64 reference (validate-gpu) and the smoke check
"""
