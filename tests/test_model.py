"""The decode loop on the CPU (persistentkv.model), against transformers' LlamaForCausalLM.

* Parity: the config's tiny random model in our loop (NumPy executor, and torch-sdpa planned for
  the reservation with its mask following the lengths) against LlamaForCausalLM built from a
  LlamaConfig with the same weights copied in (float32, eager attention): a real prefill of a
  ragged batch on scattered pages, then 32 greedy decode steps; logits within 1e-5 of the largest
  |logit| at every step, and the same tokens.
* Units: the rotary embedding against transformers' own, the append's page and slot across a
  page boundary, seeded top-k sampling, rows arriving and leaving with a trace, the configs'
  model shapes, and the memory refusal.
"""

from __future__ import annotations

import dataclasses

from pathlib import Path

import numpy as np
import pytest

from persistentkv import cli, configuration
from persistentkv.errors import PKVError

torch = pytest.importorskip("torch", reason="the decode loop runs on torch")
transformers = pytest.importorskip("transformers", reason="parity is checked against transformers' Llama")

from persistentkv.model import (DecodeLoop, Model, ModelShape, PagedKV, PagePool, Sampling,  # noqa: E402
                                check_fits, footprint, model_cases, model_shape, random_weights, sample)
from persistentkv.model.llama import apply_rotary, inv_freq, rotary_cos_sin, uniform_noise  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = configuration.load_config(ROOT / "config" / "config.yaml", base_dir=ROOT)
TINY = model_shape(CONFIG, "tiny")
PAGE = 4
STEPS = 32
PROMPTS = (5, 11, 17)   # ragged, each ending mid-page at page size 4


def hf_model(shape: ModelShape, weights):
    """LlamaForCausalLM of ``shape`` in float32 with ``weights`` copied in (strict: every tensor)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                         intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                         num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                         head_dim=shape.head_dim, rms_norm_eps=shape.rms_norm_eps,
                         rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
                         max_position_embeddings=256, tie_word_embeddings=False, attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    A, KV, I = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.intermediate_size
    state = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.norm,
             "lm_head.weight": weights.lm_head}
    for l in range(shape.num_layers):
        p = f"model.layers.{l}."
        qkv, gate_up = weights.qkv[l], weights.gate_up[l]
        state.update({p + "input_layernorm.weight": weights.attn_norm[l],
                      p + "post_attention_layernorm.weight": weights.mlp_norm[l],
                      p + "self_attn.q_proj.weight": qkv[:A], p + "self_attn.k_proj.weight": qkv[A:A + KV],
                      p + "self_attn.v_proj.weight": qkv[A + KV:], p + "self_attn.o_proj.weight": weights.o[l],
                      p + "mlp.gate_proj.weight": gate_up[:I], p + "mlp.up_proj.weight": gate_up[I:],
                      p + "mlp.down_proj.weight": weights.down[l]})
    model.load_state_dict(state, strict=True)
    return model


def tiny_loop(backend: str, weights, num_pages: int = 64, sampling: Sampling = Sampling()):
    kv = PagedKV(TINY, num_pages, PAGE, torch.float32, "cpu", seed=5)
    return DecodeLoop(Model(TINY, weights), kv, backend, sampling)


def prompts(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY.vocab_size, n) for n in PROMPTS]


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY, torch.float32, "cpu", seed=20260622)


@pytest.fixture(scope="module")
def reference(weights):
    """transformers' logits (float32 [steps + 1, B, V]) and greedy tokens over the same steps,
    each row run alone (no padding) with its whole sequence so far."""
    model = hf_model(TINY, weights)
    logits, tokens = [], []
    with torch.no_grad():
        for prompt in prompts():
            seq, row_logits = list(prompt), []
            for _ in range(STEPS + 1):
                last = model(input_ids=torch.tensor([seq])).logits[0, -1]
                row_logits.append(last)
                seq.append(int(last.argmax()))
            logits.append(torch.stack(row_logits))
            tokens.append(seq[len(prompt):])
    return torch.stack(logits, dim=1), torch.tensor(tokens).T


@pytest.mark.parametrize("backend", ["numpy", "torch-sdpa"])
def test_logits_and_greedy_tokens_match_transformers(backend, weights, reference):
    ref_logits, ref_tokens = reference
    loop = tiny_loop(backend, weights)
    with torch.no_grad():
        first = torch.stack([loop.prefill(rid, p, reserve=p.size + STEPS + 3) for rid, p in enumerate(prompts())])
        logits, tokens = [first], [loop.next_tokens().clone()]
        for _ in range(STEPS):
            logits.append(loop.step().clone())
            tokens.append(loop.tokens.clone())
    ours = torch.stack(logits)
    scale = ref_logits.abs().amax(dim=-1, keepdim=True)
    worst = float(((ours - ref_logits).abs() / scale).max())
    assert worst <= 1e-5, f"logits differ by {worst:.2e} of the largest |logit|"
    assert torch.equal(torch.stack(tokens), ref_tokens)
    assert loop.mode == ("replan" if backend == "numpy" else "device")
    # the rows' pages are scattered over the pool, not handed out in order
    pages = np.concatenate([loop.kv.pool.pages(r) for r in loop.rows])
    assert not np.array_equal(pages, np.sort(pages))


def test_rotary_matches_transformers_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    D, theta = 64, 500000.0
    gen = torch.Generator().manual_seed(3)
    positions = torch.tensor([0, 1, 7, 4095, 131071, 300000])
    q = torch.randn(len(positions), 4, D, generator=gen)
    k = torch.randn(len(positions), 2, D, generator=gen)
    freq = inv_freq(D, theta, "cpu")
    cos, sin = rotary_cos_sin(positions, freq, torch.float32)
    # transformers' layout: q [B, H, T, D] with cos [B, T, D]; here one row of T tokens
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(apply_rotary(q, cos, sin), hq[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), hk[0].transpose(0, 1))
    # transformers' inverse frequencies, from its own rope initialisation
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_freq, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(
        transformers.LlamaConfig(head_dim=D, rope_parameters={"rope_type": "default", "rope_theta": theta}))
    assert torch.equal(freq, hf_freq)
    # the interleaved (GPT-J) pairing gives other numbers from the same inputs
    pairs = q.view(len(positions), 4, D // 2, 2)
    c, s = cos[:, None, : D // 2], sin[:, None, : D // 2]
    interleaved = torch.stack((pairs[..., 0] * c - pairs[..., 1] * s, pairs[..., 1] * c + pairs[..., 0] * s), -1)
    assert not torch.allclose(interleaved.reshape(q.shape)[1:], hq[0].transpose(0, 1)[1:], atol=1e-3)


def test_append_writes_the_rows_page_and_slot_across_a_page_boundary(weights):
    """Row 0 has 3 tokens cached (page size 4): its next two tokens go to slot 3 of its first page
    and slot 0 of its second; row 1 (6 cached) to slots 2 and 3 of its second page. Nothing else
    in any layer changes, and layer 0's K is the rotated projection of the token's embedding."""
    loop = tiny_loop("torch-sdpa", weights)
    loop.admit(0, cached=3, token=11, reserve=12)
    loop.admit(1, cached=6, token=22, reserve=12)
    pages = {r: loop.kv.pool.pages(r) for r in (0, 1)}
    expect = [{0: (pages[0][0], 3), 1: (pages[1][1], 2)}, {0: (pages[0][1], 0), 1: (pages[1][1], 3)}]
    cache = loop.kv.cache
    for step, where in enumerate(expect):
        before = cache.clone()
        tokens = loop.next_tokens().clone()
        positions = torch.tensor(loop.positions_host)
        with torch.no_grad():
            loop.step()
        changed = (cache != before).any(dim=-1).any(dim=-1)  # [L, 2, pages, P]
        written = {tuple(i) for i in changed.nonzero().tolist()}
        assert written == {(l, kv, int(page), slot) for l in range(TINY.num_layers) for kv in (0, 1)
                           for page, slot in where.values()}, f"step {step}"
        model = loop.model
        h = model.kernels.rmsnorm(weights.embed[tokens], weights.attn_norm[0])
        _, k = model.kernels.rotary(torch.nn.functional.linear(h, weights.qkv[0]), positions)
        for row, (page, slot) in where.items():
            torch.testing.assert_close(cache[0, 0, page, slot], k[row], rtol=0, atol=0)


def test_top_k_sampling_is_seeded_reproducible_and_keeps_to_k():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=gen)
    keys, k = torch.tensor([3, 8, 9, 40]), 5
    top = torch.topk(logits, k).indices
    draws = torch.stack([sample(logits, k, 7, keys, torch.full((4,), p)) for p in range(2000)])
    again = torch.stack([sample(logits, k, 7, keys, torch.full((4,), p)) for p in range(2000)])
    assert torch.equal(draws, again)
    other = torch.stack([sample(logits, k, 8, keys, torch.full((4,), p)) for p in range(2000)])
    assert not torch.equal(draws, other)
    for row in range(4):
        assert set(draws[:, row].tolist()) == set(top[row].tolist())  # every draw in the top k, each drawn
        want = torch.softmax(logits[row, top[row]], dim=0)
        got = torch.stack([(draws[:, row] == t).float().mean() for t in top[row]])
        assert float((got - want).abs().max()) < 0.04  # 2000 draws: sd <= 0.011
    assert torch.equal(sample(logits, 1, 7, keys, torch.zeros(4)), logits.argmax(-1))
    # a row's draw depends on its key and position, not on the rows beside it
    u = uniform_noise(7, keys, torch.tensor([5, 5, 5, 5]), k)
    assert torch.equal(uniform_noise(7, keys[2:], torch.tensor([5, 5]), k), u[2:])
    assert float(u.min()) > 0 and float(u.max()) < 1


def test_seeded_top_k_decode_is_reproducible(weights):
    runs = []
    for _ in range(2):
        loop = tiny_loop("torch-sdpa", weights, sampling=Sampling(top_k=8, seed=4))
        with torch.no_grad():
            for rid, p in enumerate(prompts(1)):
                loop.prefill(rid, p, reserve=p.size + 10)
            drawn = []
            for _ in range(6):
                loop.step()
                drawn.append(loop.tokens.clone())
            runs.append(torch.stack(drawn))
    assert torch.equal(runs[0], runs[1])


def test_rows_arrive_and_leave_with_a_trace(weights):
    """A generated trace's steps drive the loop: positions follow the trace's lengths, continuing
    rows keep the token they sampled, pages return to the pool, each change of rows re-plans."""
    from persistentkv.traces import Request, active_steps

    requests = (Request(0, 0, 9, 5), Request(1, 0, 6, 2), Request(2, 1, 7, 6), Request(3, 3, 4, 3))
    steps = active_steps(requests, max_active=2, num_steps=None)
    loop = tiny_loop("numpy", weights, num_pages=16)
    reserve = {r.id: r.prompt_len + r.decode_steps for r in requests}
    last, changes = {}, 0
    with torch.no_grad():
        for step in steps:
            changes += loop.follow(step.request_ids, step.lengths, reserve, first_token=lambda rid: 3 + rid)
            fed = dict(zip(loop.rows, loop.next_tokens().tolist()))
            for rid in loop.rows:
                assert fed[rid] == last.get(rid, 3 + rid)
            np.testing.assert_array_equal(loop.positions_host, np.asarray(step.lengths) - 1)
            logits = loop.step()
            assert torch.isfinite(logits).all()
            last = dict(zip(loop.rows, loop.tokens.tolist()))
        for rid in list(loop.rows):
            loop.retire(rid)
    assert changes == sum(1 for a, b in zip((None,) + steps, steps) if a is None or a.request_ids != b.request_ids)
    assert loop.kv.pool.free == 16
    assert loop.replans == len(steps)  # the NumPy executor's plan is made on the host, once per step


def test_config_models():
    eight = model_shape(CONFIG, "llama3_8b")
    assert (eight.hidden_size, eight.num_heads, eight.num_kv_heads, eight.head_dim, eight.num_layers,
            eight.intermediate_size, eight.vocab_size, eight.rope_theta) == (4096, 32, 8, 128, 32, 14336, 128256,
                                                                            500000.0)
    assert round(eight.step_weight_bytes("float16", 1) / 1e9, 1) == 15.0
    assert eight.kv_bytes_per_token("float16") == 128 * 1024
    for model in (eight, model_shape(CONFIG, "llama3_70b_tp8")):   # the matrices + norms + embedding rows
        matrices = sum(nbytes * count for nbytes, count in model.step_matrices("float16").values())
        norms = (2 * model.num_layers + 1) * model.hidden_size * 2
        assert matrices + norms + model.hidden_size * 2 == model.step_weight_bytes("float16", 1)
    assert eight.step_matrices("float16")["o"] == (4096 * 4096 * 2, 32)
    shard = model_shape(CONFIG, "llama3_70b_tp8")
    assert (shard.num_heads, shard.num_kv_heads, shard.tensor_parallel, shard.num_layers) == (8, 1, 8, 80)
    assert "all-reduce" in shard.note
    assert model_cases(CONFIG, "llama3_8b")[0] == (1, 4096) and model_cases(CONFIG, "tiny") == []
    with pytest.raises(PKVError, match="not in the config's models"):
        model_shape(CONFIG, "llama2")
    with pytest.raises(PKVError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        ModelShape("bad", 64, 6, 4, 64, 1, 64, 64)
    bad = {**CONFIG, "models": {"tiny": {**CONFIG["models"]["tiny"], "colour": "blue"}}}
    with pytest.raises(PKVError, match="models.tiny: unknown key 'colour'"):
        configuration.validate_config(bad, base_dir=ROOT)


def test_a_configuration_that_does_not_fit_is_refused_in_one_line():
    eight = model_shape(CONFIG, "llama3_8b")
    pages = 64 * 32768 // 16
    need = footprint(eight, "float16", pages, 16, batch_size=64, backends=4)
    with pytest.raises(PKVError) as info:
        check_fits(need, free_bytes=140 * 2**30, what="llama3_8b at B=64 x 32768")
    message = str(info.value)
    assert "\n" not in message and message.startswith("llama3_8b at B=64 x 32768 needs 272.")
    assert "KV cache 256.0" in message and "weights 15." in message
    resident = dataclasses.replace(need, weights=0)     # a cell of measure-e2e: the weights are loaded
    with pytest.raises(PKVError, match=r"\(the weights already on the device, KV cache 256\.0"):
        check_fits(resident, free_bytes=140 * 2**30, what="llama3_8b at B=64 x 32768")
    check_fits(footprint(eight, "float16", 4 * 32768 // 16, 16, batch_size=4, backends=4), 140 * 2**30, "fits")
    pool = PagePool(4, 16)
    pool.reserve(0, 40)
    with pytest.raises(PKVError, match="row 1 needs 2 pages for 17 tokens; 1 of 4 are free"):
        pool.reserve(1, 17)


def test_a_row_that_fills_its_reservation_is_refused(weights):
    loop = tiny_loop("torch-sdpa", weights)
    loop.admit(0, cached=6, token=1, reserve=8)
    with torch.no_grad():
        loop.step()
        loop.step()
        with pytest.raises(PKVError, match="row 0 has filled the 8 tokens it reserved"):
            loop.step()


def test_measure_e2e_without_a_gpu_says_so_in_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code = cli.main(["measure-e2e", "--config", str(ROOT / "config" / "config.yaml"),
                     "--out", str(tmp_path / "e2e.parquet")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: no CUDA device") and err.count("\n") == 1
    assert not (tmp_path / "e2e.parquet").exists()


def test_measure_e2e_rows_and_table_from_known_times():
    """The command's rows keep their dtypes, and its table computes the step against the best
    baseline and the Amdahl prediction from the attention times (numbers chosen by hand)."""
    import pandas as pd

    from persistentkv.commands import measure_e2e as e2e

    assert e2e.parse_cases("1x4096, 64X32768") == [(1, 4096), (64, 32768)]
    with pytest.raises(PKVError, match="'4k' is not BxCONTEXT"):
        e2e.parse_cases("4k")
    assert e2e.default_backends(CONFIG)[0] == "pkv-workqueue" and "adaptive" not in e2e.default_backends(CONFIG)
    eight = model_shape(CONFIG, "llama3_8b")
    setting = e2e.Setting("run", eight, "float16", 16, "cases", 1, "torch", 2**34)
    # best baseline: 1000 us a step, 300 of it attention; ours: 900 us with 180 us of attention
    times = {"flashinfer-tc": (1000.0, 300.0), "vllm-fa3": (1100.0, 350.0), "pkv-workqueue": (900.0, 180.0)}
    rows = [setting.row(name, 4, [32768] * 4, 0, repeat=r, step_us=s + r, attention_us=a, non_attention_us=s - a,
                        tokens_per_s=4 / (s * 1e-6), weight_floor_us=560.0)
            for name, (s, a) in times.items() for r in range(3)]
    rows += e2e._refused_rows(setting, ["trtllm-xqa"], 4, [32768] * 4, 0, {"trtllm-xqa": "no flashinfer"},
                              "unavailable")
    frame = pd.DataFrame(rows, columns=list(e2e.E2E_COLUMNS)).astype(e2e.E2E_COLUMNS)
    assert frame.loc[0, "kv_bytes"] == 4 * 32768 * 128 * 1024 and frame.loc[0, "total_tokens"] == 4 * 32768
    table = e2e.summary_table(frame).splitlines()
    ours = next(line for line in table if "pkv-workqueue" in line).split()
    # step 901 (median of 900..902); vs best 1001/901; Amdahl 1001 / (1001 - 300 + 180); rest 560/720
    assert ours[2] == "4x32768" and ours[4] == "901.0"
    assert ours[-3:] == [f"{1001 / 901:.3f}", f"{1001 / 881:.3f}", f"{560 / 720:.2f}"]
    assert not any("trtllm-xqa" in line for line in table)


def test_loops_over_one_cache_share_a_rows_pages(weights):
    """Every backend's loop over one cache reads the same bytes: a row admitted by two loops holds
    one set of pages, which return to the pool only when both loops let the row go."""
    kv = PagedKV(TINY, 16, PAGE, torch.float32, "cpu", seed=2)
    loops = [DecodeLoop(Model(TINY, weights), kv, name) for name in ("numpy", "torch-sdpa")]
    for loop in loops:
        loop.admit(7, cached=5, token=1, reserve=12)
    assert kv.pool.free == 13
    with torch.no_grad():
        steps = [loop.step().clone() for loop in loops]
    torch.testing.assert_close(steps[0], steps[1], rtol=1e-5, atol=1e-5)  # the same cache, two executors
    loops[0].retire(7)
    assert kv.pool.free == 13 and kv.pool.pages(7).size == 3
    loops[1].retire(7)
    assert kv.pool.free == 16
    with pytest.raises(PKVError, match="row 3 holds 1 pages; another reservation asks for 2"):
        kv.pool.reserve(3, 4)
        kv.pool.reserve(3, 8)


def test_a_models_traces_come_from_the_config_and_an_unknown_one_is_refused():
    from persistentkv.configuration import load_config
    from persistentkv.errors import PKVError
    from persistentkv.model import model_shape, model_traces

    config = load_config("config/config.yaml")
    generated = [t["name"] for t in config["traces"] if t["kind"] != "file"]
    assert model_traces(config, "llama3_8b", generated) == config["models"]["llama3_8b"]["traces"]
    assert model_traces(config, "tiny", generated) == generated  # names none: every generated trace
    model_shape(config, "llama3_8b")  # `traces` is not a shape field
    config["models"]["tiny"]["traces"] = ["bimodal_b8", "no_such_trace"]
    with pytest.raises(PKVError, match="models.tiny.traces: no_such_trace is not a trace"):
        model_traces(config, "tiny", generated)


def test_a_replan_drops_the_graphs_that_read_the_old_plan(weights):
    """A replan-mode loop (host-planned items: numpy here, pkv-buckets and pkv-split on the GPU)
    whose lengths change gets a new plan with new buffers; a graph captured before it would read
    the old, freed ones, so every graph goes and the next replay re-captures. (A stale attention
    graph, kept because only the step's lengths were compared, faulted on the H200:
    benchmarks/NOTES.md, "The full decode step".)"""
    loop = tiny_loop("numpy", weights)
    for rid, n in enumerate((20, 37)):
        loop.admit(rid, n, 1, 64)
    loop.next_tokens()
    assert loop.mode == "replan"
    sentinel = {"step": object(), "attention": object()}
    loop._graphs = dict(sentinel)  # what capture() leaves; capturing itself needs a GPU
    plan = loop.plan
    assert loop.graph_ready("step") and loop.graph_ready("attention")  # nothing changed: kept
    assert loop.plan is plan and loop.recaptures == 0
    loop.set_positions(loop.positions_host + 1)  # the lengths grow by one
    assert not loop.graph_ready("attention") and not loop.graph_ready("step")
    assert loop.plan is not plan and loop.recaptures == 1
    loop._graphs = dict(sentinel)
    loop.follow([1], [39], {1: 64}, lambda rid: 0)  # row 0 leaves: rebuilt, graphs dropped
    assert not loop.graph_ready("step") and loop.recaptures == 2


def test_a_dropped_loop_is_freed_at_once_without_the_cycle_collector(weights):
    """A loop is in no reference cycle of its own: dropped, its graphs, plan and buffers go at once,
    not at some later collection (which, inside another graph's capture, invalidated it on an H100)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        loop = tiny_loop("numpy", weights)
        loop.admit(0, 20, 1, 64)
        loop.step()
        loop._graphs = {"step": object()}  # what capture() leaves; capturing itself needs a GPU
        gone = weakref.ref(loop)
        del loop
        assert gone() is None
    finally:
        gc.enable()
    loop = tiny_loop("numpy", weights)
    with pytest.raises(PKVError, match="capture what must be one of step, rest, got 'attention'"):
        loop.capture("attention")


def test_attention_alone_appends_into_the_next_slot_and_leaves_the_step_unchanged(weights):
    """AttentionAlone (measure-e2e's attention-alone graph, eagerly): each layer's append
    writes the fixed k, v into every row's next slot, positions stay, and the next step, whose own
    append overwrites those slots first, gives the logits it gives without it."""
    from persistentkv.measure.steps import AttentionAlone

    plain, probed = tiny_loop("torch-sdpa", weights), tiny_loop("torch-sdpa", weights)
    alone = AttentionAlone(probed)
    with torch.no_grad():
        for loop in (plain, probed):
            for rid, p in enumerate(prompts()):
                loop.prefill(rid, p, reserve=p.size + 4)
            loop.next_tokens()  # the rows' device state (positions) is built here
        before = probed.positions.clone()
        alone()
        assert torch.equal(probed.positions, before)
        _, k, v = alone.probe
        P = probed.kv.page_size
        for row, pos in enumerate(before.tolist()):
            slot = int(probed.table[row, pos // P]) * P + pos % P
            for l in range(TINY.num_layers):
                k_flat, v_flat = probed.kv.flat(l)
                assert torch.equal(k_flat[slot], k[row]) and torch.equal(v_flat[slot], v[row])
        assert torch.equal(probed.step(), plain.step())
