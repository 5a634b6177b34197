"""``persistentkv measure``: one experiment under the fair protocols and the published one (GPU).

    persistentkv measure --config config/config.yaml --experiment published \
        --traces-dir build/traces --out results/nvidia-h200/raw/published.parquet \
        [--policy results/nvidia-h200/policy.json] [--backends a,b,...] [--quick] [--kv-dtype float8_e4m3]

``--kv-dtype float8_e4m3`` measures one of names.FP8_EXPERIMENTS on e4m3 caches (per-tensor scales,
the query in the spec's dtype), into results/<hw>/raw_fp8/<experiment>.parquet: the FP8 policy's
calibration and its holdout rows.

Writes the raw rows of docs/DATA.md (every repeat of every backend and protocol, plus the read
and copy ceilings measured in the same process) and the provenance sidecar (same path, .json).
"""

from __future__ import annotations

import argparse

from ..backends import registry
from ..errors import require
from ..measure.device import require_cuda
from ..names import EXPERIMENTS, FP8_EXPERIMENTS, KV_GRID_SUFFIX

#: --kv-dtype's values: ``auto``, the cache of the config spec's own dtype, or a cache dtype whose
#: grid has files of its own (names.KV_GRID_SUFFIX).
KV_DTYPE_CHOICES = ("auto", *KV_GRID_SUFFIX)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="config/config.yaml")
    parser.add_argument("--experiment", required=True, choices=EXPERIMENTS, help="which grid to measure")
    parser.add_argument("--traces-dir", default="build/traces", help="folder of {trace}_s{seed}.json")
    parser.add_argument("--out", required=True, help="results/{hw}/raw/{experiment}.parquet")
    parser.add_argument("--policy", default=None, help="policy.json for the adaptive backend")
    parser.add_argument("--backends", default=None, help="comma-separated subset (default: config measure.backends)")
    parser.add_argument("--quick", action="store_true",
                        help="one holdout seed, 4x the step stride, 2 repeats: a smoke run, not a result")
    add_kv_dtype(parser, "results/<hw>/raw_fp8/<experiment>.parquet; experiments "
                 + ", ".join(FP8_EXPERIMENTS))


def parse_names(text: str | None, known, what: str) -> list[str] | None:
    """A comma list of ``--<what>`` among ``known`` (None for None): an unknown name or an empty
    list is one line naming it."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    require(names and not unknown, f"--{what}: unknown {', '.join(unknown) or 'empty list'}; "
                                   f"expected among {', '.join(known)}")
    return names


def parse_backends(text: str | None) -> list[str] | None:
    if not text:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    require(names, f"--backends {text!r} names no backend")
    unknown = [n for n in names if n not in registry.names()]
    require(not unknown, f"unknown backend(s) {', '.join(unknown)} in --backends; expected among {', '.join(registry.names())}")
    return names


def add_kv_dtype(parser: argparse.ArgumentParser, out_example: str) -> None:
    """The kernel grids' --kv-dtype (checked by :func:`parse_kv_dtype`, which says what is wrong in
    one line, where argparse's choices would print its usage too)."""
    parser.add_argument("--kv-dtype", default="auto", metavar="{" + ",".join(KV_DTYPE_CHOICES) + "}",
                        help=f"the KV cache's dtype: auto (the config spec's dtype) or float8_e4m3 (e4m3 codes with "
                             f"per-tensor scales; every row's kv_dtype says which; write it to {out_example})")


def parse_kv_dtype(text: str) -> str | None:
    """--kv-dtype as AttentionSpec.kv_dtype: None for ``auto`` (the spec's own dtype)."""
    require(text in KV_DTYPE_CHOICES, f"--kv-dtype {text!r} is not one of {', '.join(KV_DTYPE_CHOICES)}")
    return None if text == "auto" else text


def run(args: argparse.Namespace) -> int:
    kv_dtype = parse_kv_dtype(args.kv_dtype)
    require(kv_dtype is None or args.experiment in FP8_EXPERIMENTS,
            f"--kv-dtype {args.kv_dtype} measures the experiments {', '.join(FP8_EXPERIMENTS)} "
            f"(the FP8 policy's calibration and holdout), not {args.experiment}")
    require_cuda()
    from ..measure.runner import run_experiment  # the harness and pandas: loaded to run, not for --help

    backends = parse_backends(args.backends)
    return run_experiment(args.config, args.experiment, args.traces_dir, args.out, args.policy, backends,
                          args.quick, kv_dtype)
