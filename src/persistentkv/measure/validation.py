"""Every backend against the independent float64 reference, on the device.

For each case the K/V pages are generated on the host (float32 standard normals, seeded), rounded
to the serving dtype there, and copied to the device, so the float64 reference
(persistentkv.reference.reference_decode, which never looks at a plan) sees exactly the bytes the
backends read. Each backend's output buffer is poisoned first with a value no attention output can
take (a convex combination of V rows of standard normals stays far inside +-24576), so a kernel that
skips an output element is caught as ``unwritten`` rather than passing on stale data.

A row per (trace, seed, step, backend, dtype): the gate, per (row, query head) (reference.gate):
max_row_head_err = the worst ||out[b, h] - ref[b, h]|| / ||ref[b, h]|| (inf where out holds NaN),
at worst_row / worst_head, and row_heads_failing over rtol (config validation.gpu.rtol_<dtype>,
default reference.TOLERANCE); passed = no NaN, nothing unwritten and max_row_head_err <= rtol.
Also rel_err = ||out - ref|| / ||ref|| over the whole batch (kept for continuity; not a gate),
max_abs_err, nan_count, unwritten, status (ok / unavailable / failed) and reason.

An FP8 spec (``kv_dtype`` float8_e4m3): the float32 K and V are quantised on the host to e4m3
codes with one scale per tensor (their largest magnitude / 448, persistentkv.fp8.fit_scale: the
scale every FP8 baseline takes), the backends read those codes, and the reference reads their
dequantised values (code x scale, float64): the gate measures the attention, not the cache's
rounding, at the dtype's tolerance. A backend that declares ``fp8_query`` (it rounds the query
to e4m3) is gated at the same tolerance; its row says ``fp8_query`` and a miss is reported with
its measured error but does not fail the command (``failing``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from .. import fp8
from ..cache import Batch
from ..reference import TOLERANCE, gate, reference_decode, relative_error
from ..traces import KV_SEED_OFFSET, Q_SEED_OFFSET
from .rows import availability, one_line
from .workload import Case, Variant

#: Exactly representable in float16 and bfloat16 (-1.5 x 2**14); |attention output| <= max |V|.
POISON = -24576.0
DTYPES = ("float16", "bfloat16")


def host_inputs(batch: Batch, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 K, V [pages, P, Hkv, D] and q [B, Hq, D], standard normal, seeded like the artifact
    (K/V from ``seed + 7``, q from ``seed + 2026``). Drawn with torch's CPU generator, which is
    multi-threaded: a 130K-token step holds 270M values."""
    import torch

    spec = batch.spec
    shape = (batch.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    gen = torch.Generator().manual_seed(int(seed) + KV_SEED_OFFSET)
    k = torch.randn(shape, generator=gen, dtype=torch.float32)
    v = torch.randn(shape, generator=gen, dtype=torch.float32)
    gen_q = torch.Generator().manual_seed(int(seed) + Q_SEED_OFFSET)
    q = torch.randn((batch.batch_size, spec.num_qo_heads, spec.head_dim), generator=gen_q, dtype=torch.float32)
    return k.numpy(), v.numpy(), q.numpy()


def rounded(values: np.ndarray, dtype: str):
    """(torch CPU tensor in ``dtype``, NumPy array holding exactly those values)."""
    import torch

    source = torch.from_numpy(values)
    if dtype == "float16":
        t = source.to(torch.float16)
        return t, t.numpy()
    if dtype == "bfloat16":
        t = source.to(torch.bfloat16)
        return t, t.to(torch.float32).numpy()  # bfloat16 values are exact in float32
    if dtype in ("float32", "float64"):
        t = source.to(getattr(torch, dtype))
        return t, t.numpy()
    raise ValueError(f"unsupported dtype {dtype}")


def compare(out: np.ndarray, ref: np.ndarray, rtol: float, seq_lens=None, poison: float | None = POISON
            ) -> dict[str, Any]:
    """Error metrics of ``out`` [B, Hq, D] (any float dtype) against the float64 reference, gated
    per (row, query head) (reference.gate; ``seq_lens`` names the worst row's length in the
    reason), plus ``reason``: '' when passed, else why (the worst (row, head) first). ``unwritten``
    counts the elements still holding ``poison``, the value the output was filled with; an output
    that was not poisoned (``poison=None``, validate-cpu's) has no ``unwritten`` column."""
    out64 = np.asarray(out, dtype=np.float64)
    nan_count = int(np.isnan(out64).sum())
    unwritten = int((out64 == poison).sum()) if poison is not None else 0
    verdict = gate(out64, ref, rtol, seq_lens)
    finite = np.isfinite(out64)
    max_abs = float(np.max(np.abs(np.where(finite, out64, 0.0) - ref))) if out64.size else 0.0
    if not finite.all():
        max_abs = math.inf
    passed = bool(nan_count == 0 and unwritten == 0 and verdict.passed)
    reasons = [] if verdict.passed else [verdict.describe()]
    if nan_count:
        reasons.append(f"{nan_count} NaN")
    if unwritten:
        reasons.append(f"{unwritten} elements never written")
    metrics = {"rel_err": float(relative_error(out64, ref)), "max_row_head_err": verdict.max_err,
               "worst_row": verdict.worst_row, "worst_head": verdict.worst_head,
               "row_heads_failing": verdict.failing, "max_abs_err": max_abs, "nan_count": nan_count,
               "unwritten": unwritten, "passed": passed, "reason": "" if passed else "; ".join(reasons)}
    if poison is None:
        del metrics["unwritten"]
    return metrics


def validate_case(case: Case, device, factory, dtypes=DTYPES, rtols: dict[str, float] | None = None,
                  inputs=None, log=print) -> list[dict]:
    """Rows for every variant of ``case`` in every dtype (see the module docstring)."""
    rtols = rtols or TOLERANCE
    k32, v32, q32 = inputs if inputs is not None else host_inputs(case.batch, case.seed + case.step)
    fp8_cache = fp8_inputs(k32, v32) if case.spec.fp8_kv else None
    rows: list[dict] = []
    for dtype in dtypes:
        spec = replace(case.spec, dtype=dtype)
        batch = replace(case.batch, spec=spec)
        if fp8_cache is None:
            k_host, k_ref = rounded(k32, dtype)
            v_host, v_ref = rounded(v32, dtype)
            source = (k_host, v_host)
        else:
            source, (k_ref, v_ref) = fp8_cache
        q_host, q_ref = rounded(q32, dtype)
        ref = reference_decode(q_ref, k_ref, v_ref, batch)
        base = dict(trace=case.trace, seed=int(case.seed), step=int(case.step), dtype=dtype,
                    kv_dtype=spec.cache_dtype, fp8_query=False, rtol=float(rtols[dtype]))
        try:
            copies = device.make_copies(batch, 1, case.seed, source=source)
            q = q_host.to(device.device)
        except Exception as exc:
            if device.is_oom(exc):
                device.empty_cache()
            rows += [_status(base, v.name, "failed", f"building the case on the device: {one_line(exc)}")
                     for v in case.variants]
            continue
        for variant in case.variants:
            rows.append(_validate_one(variant, factory, spec, batch, device, copies, q, ref, base))
        del copies, q
    return rows


def fp8_inputs(k32: np.ndarray, v32: np.ndarray) -> tuple[tuple, tuple[np.ndarray, np.ndarray]]:
    """((K codes, V codes, k_scale, v_scale) as make_copies takes them, (K, V) float64 as the
    reference reads them): e4m3 codes of K and V with one scale per tensor (torch's cast on the
    CPU, saturating: fp8.quantize_e4m3) and their dequantised values."""
    import torch

    (kc, ks, k64), (vc, vs, v64) = [_e4m3(torch.from_numpy(values)) for values in (k32, v32)]
    return (kc, vc, ks, vs), (k64, v64)


def _e4m3(values) -> tuple:
    """(codes, scale, their values in float64) of one float32 tensor, one scale for all of it."""
    import torch

    scale = fp8.fit_scale(values.numpy())
    codes = fp8.quantize_e4m3(values, float(scale[0]))
    return codes, scale, fp8.dequantize(codes.view(torch.uint8).numpy(), scale)


def _status(base: dict, backend: str, status: str, reason: str) -> dict:
    return dict(base, backend=backend, rel_err=math.nan, max_row_head_err=math.nan, worst_row=-1, worst_head=-1,
                row_heads_failing=0, max_abs_err=math.nan, passed=False, nan_count=0, unwritten=0, status=status,
                reason=reason)


def _validate_one(variant: Variant, factory, spec, batch: Batch, device, copies, q, ref, base) -> dict:
    backend, reasons = availability(factory, variant, spec,
                                    f"{variant.name} runs on NumPy arrays on the host (validate-cpu checks it)")
    if reasons:
        return _status(base, variant.name, "unavailable", "; ".join(reasons))
    try:
        plan = backend.plan(batch)
        out = device.empty_out(spec, batch.batch_size)
        out.fill_(POISON)
        backend.run(q, copies.pair(0), plan, out)
        device.synchronize()
        result = out.to("cpu").to(device.torch.float64).numpy()
    except Exception as exc:
        if device.is_oom(exc):
            device.empty_cache()
        return _status(base, variant.name, "failed", one_line(exc))
    row = dict(base, backend=variant.name, status="ok", **compare(result, ref, base["rtol"], batch.seq_lens))
    if spec.fp8_kv and backend.capabilities.fp8_query:
        row["fp8_query"] = True
        if not row["passed"]:
            row["reason"] = f"the query is rounded to e4m3 (the backend's FP8 path), reported, not gated: {row['reason']}"
    return row


def failing(rows: list[dict]) -> list[dict]:
    """Rows that fail the command: a backend that ran and missed the tolerance, or raised; a
    backend whose FP8 path rounds the query to e4m3 (``fp8_query``) is reported with its measured
    error, not failed on it."""
    return [r for r in rows if r["status"] == "failed" or (r["status"] == "ok" and not r["passed"]
                                                          and not r.get("fp8_query", False))]
