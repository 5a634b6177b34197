"""The step gemv's launch constants, side by side (development; GPU).

    python benchmarks/tune_gemv.py [--rounds 15] [--out DIR]

Each configuration (UNROLL, BLOCK_WARPS, MIN_BLOCKS_PER_SM, TARGET_WARPS_PER_SM of
persistentkv.model.step_ops) compiles its own module; every one times the B=1 projections of
Llama-3-8B and of the Llama-3-70B shard at tensor parallelism 8 (gemv, and gate|up with SiLU as
gemv_silu_mul), each a CUDA graph of one call per copy of its weights (copies spanning more than
3x the L2, so they stream from HBM as in a step), the configurations' graphs replayed in
interleaved rounds. Every configuration's output is checked against F.linear in float32 first.
Writes gemv_tune_HHMMSS.parquet: config, name, repeat, us, bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from step_probe import captured, round_order, timed  # noqa: E402

#: (unroll, block_warps, min_blocks_per_sm, target_warps_per_sm); the first is what ships
CONFIGS = ((4, 8, 2, 16), (8, 8, 2, 16), (4, 8, 2, 32), (8, 8, 2, 32), (4, 4, 4, 16), (8, 4, 4, 32), (2, 8, 2, 32))
#: name -> (N, K, silu): Llama-3-8B and its 70B shard at TP 8 (gate_up: 2I rows)
MATRICES = {"8b qkv": (6144, 4096, False), "8b o": (4096, 4096, False), "8b gate_up+silu": (28672, 4096, True),
            "8b down": (4096, 14336, False), "70b qkv": (1280, 8192, False), "70b o": (8192, 1024, False),
            "70b gate_up+silu": (7168, 8192, True), "70b down": (8192, 3584, False)}


def configure(step_ops, config):
    step_ops.UNROLL, step_ops.BLOCK_WARPS, step_ops.MIN_BLOCKS_PER_SM, step_ops.TARGET_WARPS_PER_SM = config
    for cached in (step_ops._module, step_ops._function, step_ops.gemv_shape):
        cached.cache_clear()


def main() -> int:
    import torch
    import torch.nn.functional as F

    from persistentkv.model import step_ops

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 * 2**20))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights, inputs = {}, {}
    for name, (n, k, _) in MATRICES.items():
        copies = max(2, -(-3 * l2 // (n * k * 2)))
        weights[name] = (torch.randn((copies, n, k), generator=gen, device="cuda") / k ** 0.5).half()
        inputs[name] = torch.randn((1, k), generator=gen, device="cuda").half()
    graphs = {}
    for config in CONFIGS:
        configure(step_ops, config)
        for name, (n, k, silu) in MATRICES.items():
            w, x = weights[name], inputs[name]
            got = step_ops.launch_gemv(x, w[0], silu=silu).float()
            ref = F.linear(x.float(), w[0].float())
            if silu:
                g, u = ref.chunk(2, dim=-1)
                ref = F.silu(g) * u
            err = float((got - ref).norm() / ref.norm())
            assert err < 2e-3, (config, name, err)
            outs = [None] * w.shape[0]

            def calls(w=w, x=x, silu=silu, outs=outs):
                for c in range(w.shape[0]):
                    outs[c] = step_ops.launch_gemv(x, w[c], silu=silu)

            graphs[config, name] = (captured(calls), w.shape[0], w[0].numel() * 2)
        print(f"config {config}: compiled, checked, captured", flush=True)
    rows = []
    replays = {key: replay for key, (replay, _, _) in graphs.items()}

    def order_of(r):  # per matrix, the configs rotated by r
        return [(config, name) for name in MATRICES for config in round_order(CONFIGS, r)]

    for r, times in enumerate(timed(order_of, replays, args.rounds)):
        for (config, name), us in times.items():
            _, calls, nbytes = graphs[config, name]
            rows.append(dict(config="u%d_bw%d_mb%d_tw%d" % config, name=name, repeat=r, us=us / calls, bytes=nbytes))
    frame = pd.DataFrame(rows)
    path = Path(args.out) / time.strftime("gemv_tune_%H%M%S.parquet")
    frame.to_parquet(path, index=False)
    med = frame.groupby(["name", "config"])["us"].median().unstack("config")
    print(med.round(2).to_string())
    first = "u%d_bw%d_mb%d_tw%d" % CONFIGS[0]
    print("sum over one step's projections (8b: x32 layers, 70b: x80), us:")
    layers = np.array([32 if n.startswith("8b") else 80 for n in med.index])
    total = med.mul(layers, axis=0)
    for model in ("8b", "70b"):
        part = total[[n.startswith(model) for n in total.index]].sum()
        print(f"  {model}: " + ", ".join(f"{c} {v:.0f} ({v / part[first]:.3f})" for c, v in part.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
