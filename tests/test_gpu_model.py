"""The decode loop on a GPU: every graph-safe backend inside a captured step, against a float32 loop.

* Teacher forcing: a float32 reference loop (torch-sdpa over a float32 cache, the served weights
  upcast) decodes greedily after a real prefill of eight ragged prompts (up to 4096 tokens, so the
  queues split rows); each backend's float16 loop, its own prefill in its own cache, is fed the
  reference's tokens and replays its captured step 64 times. Per step: the largest logit error;
  over the steps: top-1 agreement >= 99 % and mean KL(reference || backend) < 1e-3.
* Graph replay of our engine's step is bit-identical to its eager step.
* In steady state a ``device``-mode step replays with no host synchronisation (torch's sync
  debug mode raises on any), and a trace's arrivals and departures re-capture.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_support import requires_gpu
from persistentkv.errors import PKVError

pytestmark = [pytest.mark.gpu, requires_gpu]

PAGE = 16
STEPS = 64
PROMPTS = (37, 300, 1000, 2049, 64, 513, 4096, 129)


def gpu_shape():
    from persistentkv.model import ModelShape

    return ModelShape("gpu_small", hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=128, num_layers=3,
                      intermediate_size=1024, vocab_size=256, rope_theta=500000.0, rms_norm_eps=1e-5)


def graph_backends() -> list[str]:
    from persistentkv.backends import registry
    from persistentkv.names import ADAPTIVE, CPU_ONLY

    return [n for n in registry.names() if n not in CPU_ONLY and n not in (ADAPTIVE, "trtllm-native")]


def make_loop(backend, weights, dtype, kernels: str = "torch"):
    import torch

    from persistentkv.model import DecodeLoop, Model, PagedKV

    shape = gpu_shape()
    pages = sum(-(-(n + STEPS + 8) // PAGE) for n in PROMPTS) + 32
    kv = PagedKV(shape, pages, PAGE, getattr(torch, dtype), "cuda", seed=9)
    return DecodeLoop(Model(shape, weights, kernels, max_position=max(PROMPTS) + STEPS + 8), kv, backend)


def prefill_all(loop) -> None:
    rng = np.random.default_rng(4)
    for rid, n in enumerate(PROMPTS):
        loop.prefill(rid, rng.integers(0, gpu_shape().vocab_size, n), reserve=n + STEPS + 8)


@pytest.fixture(scope="module")
def weights():
    import torch

    from persistentkv.model import random_weights

    return random_weights(gpu_shape(), torch.float16, "cuda", seed=20260623)


@pytest.fixture(scope="module")
def reference(weights):
    """(inputs int64 [STEPS, B], logits float32 [STEPS, B, V]) of the float32 greedy loop."""
    import torch

    loop = make_loop("torch-sdpa", weights.to(torch.float32), "float32")
    inputs, logits = [], []
    with torch.no_grad():
        prefill_all(loop)
        for _ in range(STEPS):
            inputs.append(loop.next_tokens().clone())
            logits.append(loop.step().clone())
    return torch.stack(inputs), torch.stack(logits)


@pytest.mark.parametrize("backend", graph_backends())
def test_captured_step_matches_the_float32_loop_with_teacher_forcing(backend, weights, reference):
    import torch

    from persistentkv.backends import registry

    instance = registry.create(backend)
    spec = gpu_shape().attention_spec(PAGE, "float16")
    reasons = instance.unavailable(spec)
    if reasons:
        pytest.skip(f"{backend}: {'; '.join(reasons)}")
    if instance.capabilities.graph == "none":
        pytest.skip(f"{backend} is not graph-safe")
    inputs, ref = reference
    loop = make_loop(instance, weights, "float16")
    got = []
    with torch.no_grad():
        prefill_all(loop)
        loop.set_tokens(inputs[0])
        loop.capture("step")
        for t in range(STEPS):
            loop.set_tokens(inputs[t])
            loop.replay("step")
            got.append(loop.logits.clone())
    got = torch.stack(got)
    assert torch.isfinite(got).all()
    per_step = (got - ref).abs().amax(dim=(1, 2)) / ref.abs().amax(dim=(1, 2))
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    print(f"{backend} ({loop.mode}): max logit error per step <= {float(per_step.max()):.2e} of max |logit|, "
          f"top-1 agreement {agree:.4f}, mean KL {float(kl.mean()):.2e}, re-captures {loop.recaptures}")
    assert float(per_step.max()) < 2e-2
    assert agree >= 0.99
    assert float(kl.mean()) < 1e-3


def test_graph_replay_of_our_step_is_bit_identical_to_its_eager_step(weights):
    import torch

    loop = make_loop("pkv-workqueue", weights, "float16")
    with torch.no_grad():
        prefill_all(loop)
        marked = loop.mark()
        eager, eager_tokens = [], []
        for _ in range(8):
            eager.append(loop.step().clone())
            eager_tokens.append(loop.tokens.clone())
        loop.rewind(marked)
        loop.capture("step")
        for t in range(8):
            loop.replay("step")
            torch.testing.assert_close(loop.logits, eager[t], rtol=0, atol=0, msg=f"step {t}")
            assert torch.equal(loop.tokens, eager_tokens[t])
    assert loop.mode == "device" and loop.recaptures == 0


@pytest.mark.parametrize("backend", ["pkv-workqueue", "vllm-fa3", "trtllm-xqa", "torch-sdpa"])
def test_steady_state_replays_without_host_synchronisation(backend, weights):
    import torch

    from persistentkv.backends import registry

    instance = registry.create(backend)
    reasons = instance.unavailable(gpu_shape().attention_spec(PAGE, "float16"))
    if reasons:
        pytest.skip(f"{backend}: {'; '.join(reasons)}")
    loop = make_loop(instance, weights, "float16")
    with torch.no_grad():
        prefill_all(loop)
        loop.capture("step")
        loop.replay("step")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(16):
                loop.replay("step")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    assert loop.mode == "device" and loop.recaptures == 0
    np.testing.assert_array_equal(loop.positions_host, np.asarray(PROMPTS) + 17)
    assert torch.equal(loop.positions.cpu(), torch.as_tensor(loop.positions_host))


def test_trace_rows_arrive_and_leave_between_replays(weights):
    import torch

    from persistentkv.traces import Request, active_steps

    requests = (Request(0, 0, 700, 6), Request(1, 0, 90, 3), Request(2, 1, 2000, 5), Request(3, 4, 33, 4))
    steps = active_steps(requests, max_active=2, num_steps=None)
    loop = make_loop("pkv-workqueue", weights, "float16")
    loop.kv.fill_random(1)
    reserve = {r.id: r.prompt_len + r.decode_steps for r in requests}
    changes = 0
    with torch.no_grad():
        for step in steps:
            changes += loop.follow(step.request_ids, step.lengths, reserve, first_token=lambda rid: rid)
            loop.replay("step")
            assert torch.isfinite(loop.logits).all()
    assert changes == loop.recaptures + 1  # the first set of rows captures, each later change re-captures
    assert changes >= 3


@pytest.mark.parametrize("backend", ["pkv-buckets", "pkv-split"])
def test_a_replan_mode_attention_graph_follows_its_lengths(backend, weights):
    """A host-planned route re-plans when the lengths change, and its captured graphs read the
    old plan's buffers: after the step's lengths grow, the attention graph replays what an eager
    run at the new lengths computes (a stale graph kept past its plan faulted on the 70B shard's
    trace: benchmarks/NOTES.md, "The full decode step")."""
    import torch

    from persistentkv.measure.steps import add_alone_graphs

    loop = make_loop(backend, weights, "float16")
    alone = add_alone_graphs(loop)
    with torch.no_grad():
        prefill_all(loop)
        loop.capture("step")
        loop.capture("attention")
        assert loop.mode == "replan"
        loop.set_positions(loop.positions_host + 60)  # across pages and tiles, within the reservations
        loop.replay("attention")
        replayed = loop.out.clone()
        alone()
        torch.cuda.synchronize()
    assert torch.equal(replayed, loop.out)
    assert loop.recaptures == 1


def test_a_configuration_that_does_not_fit_is_refused_before_allocating():
    import torch

    from persistentkv.measure.device import TorchDevice
    from persistentkv.model import ModelShape, check_fits, footprint

    shard = ModelShape("llama3_70b_tp8", 8192, 8, 1, 128, 80, 3584, 16032)
    before = torch.cuda.memory_allocated()
    need = footprint(shard, "float16", 64 * 131072 * 4 // PAGE, PAGE, 64)
    with pytest.raises(PKVError, match="needs .* GiB .* use a smaller batch or context"):
        check_fits(need, TorchDevice("cuda").free_bytes(), "the 70B shard at B=256 x 131072")
    assert torch.cuda.memory_allocated() == before


# -- an FP8 cache -------------------------------------------------------------------------------
def fp8_scales(weights):
    """float32 [L, 2, Hkv]: the float16 loop's prefilled K/V, largest magnitude per layer and head
    over 448 (an offline calibration of the FP8 cache's scales)."""
    import torch

    from persistentkv.fp8 import E4M3_MAX

    loop = make_loop("torch-sdpa", weights, "float16")
    with torch.no_grad():
        prefill_all(loop)
    amax = loop.kv.cache.float().abs().amax(dim=(2, 3, 5))
    return amax / E4M3_MAX


@pytest.mark.parametrize("kernels", ["torch", "pkv"])
@pytest.mark.parametrize("backend", graph_backends())
def test_fp8_captured_step_against_the_float32_loop(backend, kernels, weights, reference):
    """The step on an FP8 cache (written by the step's own append, quantised with per-head scales),
    captured and replayed with teacher forcing: its logits against the float32 loop's, measured
    and printed (the FP8 cache's cost), gated loosely: top-1 agreement >= 95 %."""
    import torch

    from persistentkv.backends import registry
    from persistentkv.model import DecodeLoop, Model, PagedKV

    instance = registry.create(backend)
    spec = gpu_shape().attention_spec(PAGE, "float16", "float8_e4m3")
    reasons = instance.unavailable(spec)
    if reasons or instance.capabilities.graph == "none":
        pytest.skip(f"{backend}: {'; '.join(reasons) or 'not graph-safe'}")
    if kernels == "pkv" and backend != "pkv-workqueue":
        pytest.skip("the step_ops append is checked once, under our queue")
    inputs, ref = reference
    shape = gpu_shape()
    per_head = fp8_scales(weights)
    scales = per_head.amax(dim=2, keepdim=True) if backend in ("flashinfer-cc", "flashinfer-tc", "trtllm-xqa") \
        else per_head  # FlashInfer and XQA take one scale per tensor
    pages = sum(-(-(n + STEPS + 8) // PAGE) for n in PROMPTS) + 32
    kv = PagedKV(shape, pages, PAGE, torch.float16, "cuda", seed=9, kv_dtype="float8_e4m3", scales=scales)
    loop = DecodeLoop(Model(shape, weights, kernels, max_position=max(PROMPTS) + STEPS + 8), kv, instance)
    got = []
    with torch.no_grad():
        prefill_all(loop)
        loop.set_tokens(inputs[0])
        marked = loop.mark()
        loop.step()  # eager first: the baselines that read their scales on the host read them here
        loop.rewind(marked)  # its append is rewritten by the first replay, at the same slots
        loop.capture("step")
        for t in range(STEPS):
            loop.set_tokens(inputs[t])
            loop.replay("step")
            got.append(loop.logits.clone())
    got = torch.stack(got)
    assert torch.isfinite(got).all()
    per_step = (got - ref).abs().amax(dim=(1, 2)) / ref.abs().amax(dim=(1, 2))
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"FP8 {backend} ({loop.mode}, {kernels} kernels, {'per-head' if scales.shape[2] > 1 else 'per-tensor'} "
          f"scales): max logit error per step <= {float(per_step.max()):.2e} of max |logit|, top-1 agreement {agree:.4f}")
    assert agree >= 0.95
