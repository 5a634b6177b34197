"""The ragged-step CTA rule under test (benchmarks/NOTES.md, "What is next", item 2c): its seeded
steps for bench_engine, and the paired reading of bench_engine's rows.

    python benchmarks/ragged_ctas.py cases [--seeds 200:400] [--limit 10] [--num-kv-heads 8]
    python benchmarks/bench_engine.py --kv-dtype float8_e4m3 --routes workqueue --ctas 3,4 \
        --baselines '' --cases "$(python benchmarks/ragged_ctas.py cases)" --repeats 15 --out DIR
    python benchmarks/ragged_ctas.py read DIR/bench_engine_*.parquet

The rule (fixed before any row of those seeds): on an FP8 cache, where choose_ctas_per_sm returns
None (auto runs the 8-warp module), the first of 4, 3 CTAs per SM whose queue's imbalance is at
most half the 8-warp queue's is used, the mean-item floor skipped; a step the shipped rule gives 3
or 4 CTAs keeps them. The steps: B drawn from 4-128 rows, lengths lognormal around 2048 tokens
(sigma 1, clipped to 16-32768), one generator per seed; `cases` lists those the rule moves.
`read` pairs, per round, the module the rule picks (bench_engine's wqc3 or wqc4) against auto.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from persistentkv.choose import choose_ctas_per_sm, choose_warps, queue_imbalance  # noqa: E402
from persistentkv.launch import min_chunk_tiles_for  # noqa: E402
from persistentkv.plan import num_tiles  # noqa: E402

NUM_SMS = 132  # H100 and H200
#: the 8-warp module's queue (one item per SM) and the 2-CTA 4-warp module's, each with its smallest item
QUEUE8 = (NUM_SMS, min_chunk_tiles_for(8))
QUEUE4 = (2 * NUM_SMS, min_chunk_tiles_for(4))
BATCHES = (4, 8, 16, 32, 64, 128)


def ragged_step(seed: int) -> np.ndarray:
    """The seeded step's row lengths."""
    rng = np.random.default_rng(seed)
    batch = int(rng.choice(BATCHES))
    return np.clip(rng.lognormal(np.log(2048), 1.0, batch).astype(int), 16, 32768)


def rule_ctas(seq_lens, num_kv_heads: int = 8, num_sms: int = NUM_SMS) -> int | None:
    """The CTA count the rule under test runs ``seq_lens`` at (None: auto's module, unchanged)."""
    warps = choose_warps(seq_lens, 128, num_kv_heads=num_kv_heads, queue4=QUEUE4, queue8=QUEUE8)
    queue = QUEUE4 if warps == 4 else QUEUE8
    if warps != 8 or choose_ctas_per_sm(seq_lens, num_kv_heads, num_sms, queue) is not None:
        return None
    tiles = num_tiles(np.asarray(seq_lens))
    base = queue_imbalance(tiles, num_kv_heads, *queue)
    for ctas in (4, 3):
        if queue_imbalance(tiles, num_kv_heads, ctas * num_sms, min_chunk_tiles_for(4)) <= 0.5 * base:
            return ctas
    return None


def moved_steps(seeds: range, num_kv_heads: int = 8) -> list[tuple[int, np.ndarray, int]]:
    """(seed, lengths, CTA count) of each seeded step the rule moves."""
    out = []
    for seed in seeds:
        seq = ragged_step(seed)
        ctas = rule_ctas(seq, num_kv_heads)
        if ctas is not None:
            out.append((seed, seq, ctas))
    return out


def case_string(seq: np.ndarray) -> str:
    """bench_engine's --cases spelling of one ragged step."""
    return ":".join(str(int(n)) for n in seq)


def read(parquet: str, seeds: range, num_kv_heads: int = 8) -> list[dict]:
    """Per ragged case of a bench_engine parquet: the rule's module over auto, per round. bench_engine
    names a ragged case by its batch and its shortest and longest rows; the case is found among the
    seeds' steps by those."""
    import pandas as pd

    frame = pd.read_parquet(parquet)
    known = {(len(seq), int(seq.min()), int(seq.max())): ctas for _, seq, ctas in moved_steps(seeds, num_kv_heads)}
    out = []
    for case, rows in frame.groupby("case", sort=False):
        times = rows.pivot_table(index="repeat", columns="variant", values="time_us")
        lengths = case.split("N=")[-1].split("-")
        key = (int(rows.batch_size.iloc[0]), int(lengths[0]), int(lengths[-1]))
        ctas = known.get(key)
        entry = {"case": case, "ctas": ctas, "auto_us": float(times["auto"].median())}
        if ctas is not None and f"wqc{ctas}" in times:
            ratio = times[f"wqc{ctas}"] / times["auto"]
            entry.update(median=float(ratio.median()), lo=float(ratio.min()), hi=float(ratio.max()),
                         faster=int((ratio < 1).sum()), rounds=int(ratio.notna().sum()))
        out.append(entry)
    return out


def _seeds(text: str) -> range:
    first, last = (int(x) for x in text.split(":"))
    return range(first, last)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cases = sub.add_parser("cases", help="print the --cases list of the steps the rule moves")
    cases.add_argument("--seeds", default="200:400", help="first:last (exclusive) seed")
    cases.add_argument("--limit", type=int, default=10)
    cases.add_argument("--num-kv-heads", type=int, default=8)
    reader = sub.add_parser("read", help="the rule's module over auto per round, from bench_engine's parquet")
    reader.add_argument("parquet")
    reader.add_argument("--seeds", default="200:400", help="the seeds the cases were drawn from, first:last")
    reader.add_argument("--num-kv-heads", type=int, default=8)
    args = parser.parse_args(argv)
    try:
        seeds = _seeds(args.seeds)
    except ValueError:
        parser.error(f"--seeds takes first:last, e.g. 200:400, not {args.seeds!r}")
    if args.command == "cases":
        steps = moved_steps(seeds, args.num_kv_heads)[: args.limit]
        print(",".join(case_string(seq) for _, seq, _ in steps))
        for seed, seq, ctas in steps:
            print(f"seed {seed}: B={len(seq)} {int(seq.min())}-{int(seq.max())} tokens -> {ctas} CTAs", file=sys.stderr)
        return 0
    for e in read(args.parquet, seeds, args.num_kv_heads):
        line = f"{e['case']:28s} auto {e['auto_us']:7.1f} us  rule: " + (f"{e['ctas']} CTAs" if e["ctas"] else "auto's module")
        if "median" in e:
            line += f"  {e['median']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}] {e['faster']}/{e['rounds']} faster"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
