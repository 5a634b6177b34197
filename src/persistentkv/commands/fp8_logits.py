"""``persistentkv fp8-logits``: what an FP8 (e4m3) cache does to a decode loop's logits.

    persistentkv fp8-logits --config config/config.yaml --out results/nvidia-h200/fp8_logits.parquet \
        [--models llama3_8b] [--backend pkv-workqueue] [--rows 4] [--prompt 2048] [--steps 32] [--device cuda]

Per model (config ``models:``, seeded random weights: the spec's dtype on a GPU, float32 on the
CPU): ``--rows`` prompts of seeded random tokens, ragged (the longest ``--prompt`` tokens, each
next one a quarter shorter), prefilled, then ``--steps`` greedy decode steps through ``--backend``:
the reference run, over a cache in the model's dtype. Then the same prompts over an FP8 cache,
once per scales choice, per tensor and per KV head, each fitted as an offline calibration does
(each layer's largest |K| and |V| in the reference run's prefilled cache, over 448), and
teacher-forced with the reference run's tokens, so step t of both runs reads the same sequence.

One row per (model, scales, step, row): ``rel_err`` = max |logit_fp8 - logit_ref| over max
|logit_ref| (over the vocabulary), ``top1`` = whether the two argmaxes agree, ``context`` = the
tokens the row attends over; the provenance sidecar beside the file. The weights are random, so
the numbers measure the cache's rounding through a real decoder's arithmetic, not a trained
model's sensitivity to it.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from ..errors import require
from ..spec import FP8_KV

#: Column -> dtype of the rows.
COLUMNS = {"run_id": "string", "model": "string", "backend": "string", "device": "string", "dtype": "string",
           "kv_dtype": "string", "scales": "string", "step": "int64", "row": "int64", "context": "int64",
           "rel_err": "float64", "top1": "bool"}
SCALES = ("per-tensor", "per-head")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="config/config.yaml", help="config/config.yaml")
    parser.add_argument("--out", required=True, help="FILE.parquet for the rows (provenance beside it, .json)")
    parser.add_argument("--models", default=None, help="comma-separated config models (default: those with cases)")
    parser.add_argument("--backend", default=None,
                        help="the attention backend of both runs (default: pkv-workqueue on a GPU, torch-sdpa on the CPU)")
    parser.add_argument("--rows", type=int, default=4, help="prompts (rows of the batch)")
    parser.add_argument("--prompt", type=int, default=2048, help="tokens of the longest prompt")
    parser.add_argument("--steps", type=int, default=32, help="decode steps after the prefill")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when torch sees a GPU)")


def prompt_lengths(rows: int, longest: int) -> list[int]:
    """Ragged prompts: ``longest``, then each a quarter shorter (at least one token)."""
    return [max(1, int(longest * 0.75 ** i)) for i in range(rows)]


def fitted_scales(cache, per_head: bool):
    """float32 [L, 2, Hkv or 1]: each layer's (and KV head's) largest |K| and |V| of ``cache``
    [L, 2, pages, P, Hkv, D] over 448 (scale 1 where a tensor is all zeros)."""
    import torch

    from ..fp8 import E4M3_MAX

    amax = cache.float().abs().amax(dim=(2, 3, 5))
    if not per_head:
        amax = amax.amax(dim=-1, keepdim=True)
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def decode(loop, prompts, steps: int, reserve: int, tokens=None):
    """Prefill every prompt, then ``steps`` greedy steps (teacher-forced with ``tokens`` [steps, B]
    when given): the steps' logits [steps, B, V] (float32, on the host), their tokens [steps, B]
    and a copy of the cache as the prefill left it."""
    import torch

    with torch.no_grad():
        for rid, prompt in enumerate(prompts):
            loop.prefill(rid, prompt, reserve=reserve)
        prefilled = loop.kv.cache.clone()
        logits, chosen = [], []
        for t in range(steps):
            if tokens is not None:
                loop.set_tokens(tokens[t])
            chosen.append(loop.next_tokens().clone())
            logits.append(loop.step().float().cpu().clone())
    return torch.stack(logits), torch.stack(chosen), prefilled


def compare_logits(fp8_logits, ref_logits) -> tuple[np.ndarray, np.ndarray]:
    """(rel_err [steps, B], top1 [steps, B]): max |difference| over max |reference| per step and
    row, and whether the argmaxes agree."""
    top = ref_logits.abs().amax(dim=-1)
    rel = (fp8_logits - ref_logits).abs().amax(dim=-1) / top
    return rel.double().numpy(), (fp8_logits.argmax(-1) == ref_logits.argmax(-1)).numpy()


def run(args: argparse.Namespace) -> int:
    import pandas as pd
    import torch

    from .. import configuration
    from ..backends import registry
    from ..env import torch_dtype
    from ..io import atomic_write_parquet
    from ..measure.device import TorchDevice
    from ..model import DecodeLoop, Model, PagedKV, model_cases, model_shape, random_weights
    from ..model.shape import pages_for
    from ..provenance import collect, new_run_id, utc_now, write_sidecar
    from .measure import parse_names

    require(args.rows >= 1 and args.prompt >= 1 and args.steps >= 1,
            f"--rows, --prompt and --steps must be >= 1, got {args.rows}, {args.prompt}, {args.steps}")
    require(args.out.endswith(".parquet"), f"--out {args.out!r} must be a .parquet file")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    require(device in ("cuda", "cpu"), f"--device must be cuda or cpu, got {device!r}")
    require(device == "cpu" or torch.cuda.is_available(), "--device cuda: torch sees no CUDA GPU")
    config = configuration.load_config(args.config)
    known = list(config.get("models") or {})
    models = parse_names(args.models, known, "models") or [m for m in known if model_cases(config, m)]
    require(models, "the config has no models with cases; pass --models")
    backend = args.backend or ("pkv-workqueue" if device == "cuda" else "torch-sdpa")
    require(backend in registry.names(), f"--backend: unknown {backend!r}; expected among {', '.join(registry.names())}")
    dtype_name = str(config["spec"]["dtype"]) if device == "cuda" else "float32"
    dtype, P = torch_dtype(dtype_name), int(config["spec"]["page_size"])
    seed = configuration.calibration_seed(config)
    lengths = prompt_lengths(args.rows, args.prompt)
    reserve = lengths[0] + args.steps + 1
    pages = sum(pages_for(reserve, P) for _ in lengths)
    started = utc_now()
    run_id = new_run_id("fp8_logits", started)
    rows = []
    for name in models:
        shape = model_shape(config, name)
        weights = random_weights(shape, dtype, device, seed=seed)
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(0, shape.vocab_size, n) for n in lengths]
        ref_loop = DecodeLoop(Model(shape, weights), PagedKV(shape, pages, P, dtype, device, seed=seed), backend)
        ref_logits, tokens, prefilled = decode(ref_loop, prompts, args.steps, reserve)
        for scales in SCALES:
            kv = PagedKV(shape, pages, P, dtype, device, seed=seed, kv_dtype=FP8_KV,
                         scales=fitted_scales(prefilled, scales == "per-head"))
            fp8_logits, _, _ = decode(DecodeLoop(Model(shape, weights), kv, backend), prompts, args.steps, reserve, tokens)
            rel, top1 = compare_logits(fp8_logits, ref_logits)
            for t in range(args.steps):
                for b, n in enumerate(lengths):
                    rows.append(dict(run_id=run_id, model=name, backend=backend, device=device, dtype=dtype_name,
                                     kv_dtype=FP8_KV, scales=scales, step=t, row=b, context=n + t + 1,
                                     rel_err=float(rel[t, b]), top1=bool(top1[t, b])))
            print(f"{name} {scales}: max |d logit| / max |logit| {rel.max():.3e} (median {np.median(rel):.3e}), "
                  f"top-1 agreement {top1.mean():.3f} over {args.steps} steps x {len(lengths)} rows")
        del weights, ref_loop, prefilled, kv
        if device == "cuda":
            torch.cuda.empty_cache()
    frame = pd.DataFrame(rows, columns=list(COLUMNS)).astype(COLUMNS)
    require(all(math.isfinite(x) for x in frame["rel_err"]), "an FP8 run's logits are not finite")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_parquet(args.out, frame)
    write_sidecar(args.out, run_id, collect(config, [seed], started, TorchDevice(device)))
    print(f"wrote {args.out} ({len(frame)} rows)")
    return 0
