"""The decode loop on an FP8 e4m3 cache, on the CPU: what the step writes, and what it costs the logits.

The config's tiny random model runs the same prompts twice: on a float32 cache, and on an FP8
cache whose scales are fitted to the float32 run's prefilled K/V (per tensor or per KV head, one
pair per layer, largest magnitude -> 448, as an offline calibration does). The FP8 run is teacher-
forced with the float32 run's tokens, so step t of both sees the same sequence.

* The step writes FP8: after the prefill, every K/V code of the FP8 cache is exactly
  ``persistentkv.fp8.quantize`` (the NumPy quantiser, independent of torch's) of the float32
  cache's value over its scale, saturated at 448; after the decode steps the appended rows are
  still exact codes of their own run's K/V (checked on the last step's rows).
* Two executors read the FP8 cache alike: the NumPy executor and torch-sdpa give the same logits
  (within 1e-5 of the largest |logit|) at every step.
* The cost: the FP8 run's logits against the float32 run's, max |error| / max |logit| per step and
  top-1 agreement, measured and printed; gated only loosely (an FP8 path that read garbage
  would disagree on most tokens), the numbers themselves are the result.
"""

from __future__ import annotations

import numpy as np
import pytest

from persistentkv import configuration, fp8

torch = pytest.importorskip("torch", reason="the decode loop runs on torch")

from persistentkv.model import DecodeLoop, Model, PagedKV, model_shape, random_weights  # noqa: E402
from test_model import CONFIG, PAGE, PROMPTS, TINY, prompts  # noqa: E402,F401

STEPS = 24


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY, torch.float32, "cpu", seed=20260622)


def run(loop, tokens=None):
    """Prefill every prompt, then STEPS decode steps (teacher-forced with ``tokens`` [STEPS, B]
    when given); the logits [STEPS + 1, B, V] and the greedy tokens [STEPS, B]."""
    with torch.no_grad():
        logits = [torch.stack([loop.prefill(rid, p, reserve=p.size + STEPS + 3) for rid, p in enumerate(prompts())])]
        chosen = []
        for t in range(STEPS):
            if tokens is not None:
                loop.set_tokens(tokens[t])
            chosen.append(loop.next_tokens().clone())
            logits.append(loop.step().clone())
    return torch.stack(logits), torch.stack(chosen)


def fitted_scales(cache, per_head: bool):
    """float32 [L, 2, 1 or Hkv]: each layer's (and head's) largest |K| and |V| of ``cache``
    [L, 2, pages, P, Hkv, D] over 448."""
    amax = cache.abs().amax(dim=(2, 3, 5)) if per_head else cache.abs().amax(dim=(2, 3, 4, 5))[..., None]
    return torch.where(amax > 0, amax / fp8.E4M3_MAX, torch.ones_like(amax)).float()


def fp8_loop(backend, weights, scales):
    kv = PagedKV(TINY, 64, PAGE, torch.float32, "cpu", seed=5, kv_dtype="float8_e4m3", scales=scales)
    return DecodeLoop(Model(TINY, weights), kv, backend)


@pytest.fixture(scope="module")
def float32_run(weights):
    loop = DecodeLoop(Model(TINY, weights), PagedKV(TINY, 64, PAGE, torch.float32, "cpu", seed=5), "torch-sdpa")
    with torch.no_grad():
        for rid, p in enumerate(prompts()):
            loop.prefill(rid, p, reserve=p.size + STEPS + 3)
    prefilled = loop.kv.cache.clone()
    fresh = DecodeLoop(Model(TINY, weights), PagedKV(TINY, 64, PAGE, torch.float32, "cpu", seed=5), "torch-sdpa")
    logits, tokens = run(fresh)
    return prefilled, logits, tokens


def used_slots(loop) -> np.ndarray:
    """The flat cache rows (page * P + offset) holding the rows' tokens so far."""
    slots = []
    for rid, n in zip(loop.rows, loop.positions_host):
        pages = loop.kv.pool.pages(rid)
        slots += [int(pages[t // PAGE]) * PAGE + t % PAGE for t in range(int(n))]
    return np.asarray(slots)


@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
def test_the_prefill_writes_the_exact_codes_of_its_values(weights, float32_run, per_head):
    prefilled, _, _ = float32_run
    scales = fitted_scales(prefilled, per_head)
    loop = fp8_loop("torch-sdpa", weights, scales)
    with torch.no_grad():
        for rid, p in enumerate(prompts()):
            loop.prefill(rid, p, reserve=p.size + STEPS + 3)
    slots = used_slots(loop)
    assert slots.size == sum(PROMPTS)
    L, Hkv, D = TINY.num_layers, TINY.num_kv_heads, TINY.head_dim
    for l in range(L):
        for i in range(2):
            ours = loop.kv.cache[l, i].view(torch.uint8).reshape(-1, Hkv, D).numpy()[slots]
            values = prefilled[l, i].reshape(-1, Hkv, D).numpy()[slots]
            want = fp8.quantize(values, scales[l, i].numpy(), head_axis=1 if per_head else None)
            assert np.array_equal(ours, want), f"layer {l} {'KV'[i]}: {int((ours != want).sum())} codes differ"


@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
def test_fp8_logits_against_float32_and_two_executors(weights, float32_run, per_head, capsys):
    prefilled, ref_logits, ref_tokens = float32_run
    scales = fitted_scales(prefilled, per_head)
    sdpa_logits, _ = run(fp8_loop("torch-sdpa", weights, scales), ref_tokens)
    numpy_logits, _ = run(fp8_loop("numpy", weights, scales), ref_tokens)
    top = ref_logits.abs().amax(dim=-1, keepdim=True)
    executors = float(((sdpa_logits - numpy_logits).abs() / top).max())
    assert executors <= 1e-5, f"torch-sdpa and the NumPy executor differ by {executors:.2e} on one FP8 cache"
    rel = ((sdpa_logits - ref_logits).abs() / top).amax(dim=-1)  # [STEPS + 1, B]
    agree = float((sdpa_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
    with capsys.disabled():
        print(f"\nFP8 ({'per head' if per_head else 'per tensor'}) vs float32 cache, tiny model, {STEPS} teacher-forced "
              f"steps: max |d logit| / max |logit| {float(rel.max()):.3e} (median {float(rel.median()):.3e}), "
              f"top-1 agreement {agree:.3f}")
    assert float(rel.max()) > 0, "an FP8 cache that changes no logit is not being read"
    assert agree >= 0.75 and float(rel.max()) < 0.25, (agree, float(rel.max()))


@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
def test_fill_random_writes_standard_normals_through_each_heads_scale(per_head):
    """A speed run's random cache (measure-e2e's fill_random) on FP8: every K and V head,
    dequantised with its own scale, holds standard normals, whatever the scales (which differ by
    layer, K/V and head here, so a scale broadcast on the wrong axis shows as a wrong spread)."""
    heads = TINY.num_kv_heads if per_head else 1
    # from 0.02 (|x| < 8.9 is below 448 codes) to about 1 (a normal's tails still far above e4m3's
    # smallest subnormal)
    head = torch.logspace(-1.7, -0.5, heads)
    scales = torch.stack([torch.stack([head * (1 + l), head * (3 - l)]) for l in range(TINY.num_layers)])
    kv = PagedKV(TINY, 64, PAGE, torch.float32, "cpu", kv_dtype="float8_e4m3", scales=scales)
    kv.fill_random(7)
    values = kv.cache.float() * kv.scales.view(TINY.num_layers, 2, 1, 1, -1, 1)
    assert torch.isfinite(values).all()
    spread = values.std(dim=(2, 3, 5))  # [L, 2, Hkv]
    mean = values.mean(dim=(2, 3, 5))
    assert spread.shape == (TINY.num_layers, 2, TINY.num_kv_heads)
    assert torch.allclose(spread, torch.ones_like(spread), atol=0.05), spread
    assert mean.abs().max() < 0.05, mean
