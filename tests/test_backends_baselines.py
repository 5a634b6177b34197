"""Baseline adapters and the registry, on the CPU.

* The registry: names, lazy imports (a missing package never breaks another backend), one-line
  errors, reasons instead of exceptions.
* torch-sdpa runs anywhere torch does: checked against the float64 reference over ragged rows,
  page-boundary lengths, scattered pages with holes, and G in {1, 2, 4, 8}.
* FlashInfer, vLLM FA3 and XQA cannot run here, so their adapters are driven through stand-in
  modules that implement each library's documented call (FlashInfer 0.6.14 decode.py, vLLM 0.26
  vllm_flash_attn) by plain paged attention from exactly the arguments the adapter passes. A
  wrong block table, length, layout, scale or split cap in the adapter changes the output or
  fails an assertion on the recorded call.
"""

from __future__ import annotations

import math
import subprocess
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persistentkv.backends import registry
from persistentkv.cache import make_batch
from persistentkv.errors import PKVError
from persistentkv.reference import TOLERANCE, gate, reference_decode
from persistentkv.spec import AttentionSpec

torch = pytest.importorskip("torch")


# -- helpers -----------------------------------------------------------------------------------
def assert_gated(out, ref, dtype: str) -> None:
    """``out`` within TOLERANCE[dtype] of the float64 ``ref`` in every (row, query head)."""
    verdict = gate(out, ref, dtype)
    assert verdict.passed, verdict.describe()


def host_case(spec: AttentionSpec, lengths, hole_fraction=0.3, seed=0, dtype=np.float32):
    batch = make_batch(spec, lengths, hole_fraction=hole_fraction, seed=seed)
    rng = np.random.default_rng(seed + 11)
    shape = (batch.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    k = rng.standard_normal(shape).astype(dtype)
    v = rng.standard_normal(shape).astype(dtype)
    q = rng.standard_normal((batch.batch_size, spec.num_qo_heads, spec.head_dim)).astype(dtype)
    return batch, q, k, v


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, scale):
    """Plain paged decode attention in float64 from a padded block table: the semantics every
    library documents. q [B, Hq, D]; caches [pages, P, Hkv, D] (NHD); block_table [B, W]."""
    B, Hq, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(B):
        n = int(seq_lens[i])
        pages = block_table[i, : -(-n // P)].long()
        k = k_cache[pages].reshape(-1, Hkv, D)[:n].double()
        v = v_cache[pages].reshape(-1, Hkv, D)[:n].double()
        for h in range(Hkv):
            s = (q[i, h * G:(h + 1) * G].double() @ k[:, h].T) * scale
            out[i, h * G:(h + 1) * G] = torch.softmax(s, dim=-1) @ v[:, h]
    return out


# -- registry ----------------------------------------------------------------------------------
def test_registry_names_cover_every_backend():
    names = registry.names()
    for name in ("pkv-workqueue", "pkv-buckets", "pkv-split", "adaptive", "flashinfer-cc", "flashinfer-tc",
                 "vllm-fa3", "trtllm-xqa", "trtllm-native", "flashinfer-cudnn", "torch-sdpa", "numpy"):
        assert name in names
    assert len(set(names)) == len(names)


#: what each backend declares (capabilities.graph): how a captured decode step follows the lengths
DECLARED_GRAPH = {"pkv-workqueue": "device", "pkv-buckets": "replan", "pkv-split": "replan", "adaptive": "replan",
                  "flashinfer-cc": "host", "flashinfer-tc": "host", "vllm-fa3": "device", "trtllm-xqa": "device",
                  "trtllm-native": "none", "flashinfer-cudnn": "device", "torch-sdpa": "device", "numpy": "none"}


def test_every_backend_declares_its_capabilities(tmp_path):
    from persistentkv.backends.base import Backend, Capabilities

    assert set(DECLARED_GRAPH) == set(registry.names())
    for name, graph in DECLARED_GRAPH.items():
        backend = registry.create(name, **({"policy_path": tmp_path / "p.json"} if name == "adaptive" else {}))
        assert isinstance(backend, Backend), name
        caps = backend.capabilities
        assert isinstance(caps, Capabilities) and caps.graph == graph, name
        assert caps.host_arrays == (name == "numpy") and caps.plan_engine == name.startswith("pkv"), name
    assert registry.create("flashinfer-tc", cuda_graph=False).capabilities.graph == "none"
    with pytest.raises(PKVError, match="graph must be one of"):
        Capabilities(dtypes=("float16",), graph="sometimes")


def test_torch_sdpa_plan_for_the_reservation_follows_lengths_by_update_lengths():
    """A torch-sdpa plan made for whole pages (no mask) and told shorter lengths computes what a
    plan made for those lengths computes."""
    spec = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")
    backend = registry.create("torch-sdpa", device="cpu")
    full, q, k, v = host_case(spec, [64, 64, 64])
    plan = backend.plan(full)
    assert plan.mask is None
    lengths = torch.tensor([50, 17, 64], dtype=torch.int32)
    plan.update_lengths(lengths)
    qt, kt, vt = (torch.from_numpy(a) for a in (q, k, v))
    out = torch.empty_like(qt)
    backend.run(qt, (kt, vt), plan, out)
    want = paged_attention(qt, kt, vt, torch.from_numpy(full.padded_block_table()), [50, 17, 64],
                           1 / math.sqrt(spec.head_dim))
    verdict = gate(out.numpy(), want.numpy(), "float32")
    assert verdict.passed, verdict.describe()


def test_unknown_backend_is_one_line_error_naming_it():
    with pytest.raises(PKVError, match="unknown backend 'flashinfer'") as info:
        registry.create("flashinfer")
    assert "\n" not in str(info.value)


def test_available_never_raises_and_gives_reasons_here():
    spec = AttentionSpec()
    result = registry.available(spec)
    assert set(result) == set(registry.names())
    for name, reasons in result.items():
        assert isinstance(reasons, list) and all(isinstance(r, str) and r for r in reasons), name
    if not torch.cuda.is_available():
        for gpu_only in ("flashinfer-cc", "flashinfer-tc", "vllm-fa3", "trtllm-xqa", "flashinfer-cudnn"):
            assert any("CUDA" in r for r in result[gpu_only]), result[gpu_only]
    assert any("tensorrt_llm" in r for r in result["trtllm-native"])
    assert result["torch-sdpa"] == []


def test_adaptive_without_policy_is_a_reason_not_a_crash():
    reasons = registry.available(AttentionSpec(), ["adaptive"])["adaptive"]
    assert reasons and ("policy" in reasons[0] or "does not exist" in reasons[0])


def test_a_missing_module_is_a_reason(monkeypatch):
    monkeypatch.setitem(registry._ENTRIES, "ghost", registry.Entry("no_such_module_here", "Ghost"))
    with pytest.raises(PKVError, match="does not exist"):
        registry.create("ghost")
    assert "does not exist" in registry.available(AttentionSpec(), ["ghost"])["ghost"][0]


def test_registry_import_does_not_import_gpu_packages():
    code = ("import sys, persistentkv.backends.registry as r; r.names(); "
            "print(sorted(m for m in ('torch', 'flashinfer', 'vllm', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_bad_options_are_a_one_line_error():
    with pytest.raises(PKVError, match="bad options"):
        registry.create("torch-sdpa", no_such_option=1)


def test_spec_reasons_are_listed_even_without_a_gpu():
    odd = AttentionSpec(num_qo_heads=40, num_kv_heads=8, page_size=8, dtype="float32")
    result = registry.available(odd, ["flashinfer-cc", "flashinfer-tc", "trtllm-xqa", "vllm-fa3"])
    assert any("group sizes" in r for r in result["flashinfer-cc"])
    assert not any("group sizes" in r for r in result["flashinfer-tc"])
    assert any("page sizes" in r for r in result["trtllm-xqa"])
    for name in result:
        assert any("float32" in r for r in result[name]), name


def test_trtllm_native_says_why_it_does_not_run():
    backend = registry.create("trtllm-native")
    assert backend.capabilities.graph == "none"
    reasons = backend.unavailable(AttentionSpec())
    assert reasons and all(r for r in reasons)
    with pytest.raises(PKVError, match="unavailable"):
        backend.plan(make_batch(AttentionSpec(), [16]))


# -- torch-sdpa against float64 ------------------------------------------------------------------
def run_sdpa(spec, batch, q, k, v, device="cpu"):
    backend = registry.create("torch-sdpa", device=device)
    assert backend.unavailable(spec) == []
    plan = backend.plan(batch)
    qt, kt, vt = (torch.from_numpy(a) for a in (q, k, v))
    out = torch.full(qt.shape, -24576.0, dtype=qt.dtype)
    backend.run(qt, (kt, vt), plan, out)
    return out.numpy(), plan


@pytest.mark.parametrize("group_size", [1, 2, 4, 8])
@pytest.mark.parametrize("page_size", [1, 16, 32])
def test_sdpa_matches_float64_on_ragged_scattered_rows(group_size, page_size):
    spec = AttentionSpec(num_qo_heads=2 * group_size, num_kv_heads=2, head_dim=64, page_size=page_size,
                         dtype="float32")
    lengths = [1, page_size, page_size + 1, max(1, page_size - 1), 97, 300]
    batch, q, k, v = host_case(spec, lengths, hole_fraction=0.4, seed=group_size)
    out, plan = run_sdpa(spec, batch, q, k, v)
    assert plan.mask is not None
    assert_gated(out, reference_decode(q, k, v, batch), "float32")


def test_sdpa_equal_full_pages_needs_no_mask_and_is_exact():
    spec = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")
    batch, q, k, v = host_case(spec, [64, 64, 64], hole_fraction=0.0)
    out, plan = run_sdpa(spec, batch, q, k, v)
    assert plan.mask is None
    assert_gated(out, reference_decode(q, k, v, batch), "float32")


def test_sdpa_float16_within_serving_tolerance():
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="float16")
    batch, q, k, v = host_case(spec, [1, 15, 17, 1000], hole_fraction=0.5, dtype=np.float16)
    out, _ = run_sdpa(spec, batch, q, k, v)
    assert not np.isnan(out).any() and not (out == -24576.0).any()
    assert_gated(out, reference_decode(q, k, v, batch), "float16")


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=5), page_exp=st.integers(0, 5),
       group=st.sampled_from([1, 4]), rho=st.sampled_from([0.0, 0.5]), seed=st.integers(0, 1000))
def test_sdpa_property_random_batches(lengths, page_exp, group, rho, seed):
    spec = AttentionSpec(num_qo_heads=2 * group, num_kv_heads=2, head_dim=64, page_size=2 ** page_exp,
                         dtype="float32")
    batch, q, k, v = host_case(spec, lengths, hole_fraction=rho, seed=seed)
    out, _ = run_sdpa(spec, batch, q, k, v)
    assert_gated(out, reference_decode(q, k, v, batch), "float32")


def test_sdpa_plan_serves_any_copy_of_the_cache():
    """The plan holds no cache pointer: one plan, two different caches, each answer right."""
    spec = AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")
    batch, q, k, v = host_case(spec, [40, 7], seed=3)
    backend = registry.create("torch-sdpa", device="cpu")
    plan = backend.plan(batch)
    qt = torch.from_numpy(q)
    for scale in (1.0, -2.0):
        kk, vv = k * scale, v + scale
        out = torch.empty_like(qt)
        backend.run(qt, (torch.from_numpy(kk), torch.from_numpy(vv)), plan, out)
        assert_gated(out.numpy(), reference_decode(q, kk, vv, batch), "float32")


def test_step_tensor_checks_are_one_line_errors():
    spec = AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")
    batch, q, k, v = host_case(spec, [40, 7])
    backend = registry.create("torch-sdpa", device="cpu")
    plan = backend.plan(batch)
    qt, kt, vt = (torch.from_numpy(a) for a in (q, k, v))
    with pytest.raises(PKVError, match=r"q has shape \(1, 4, 64\)"):
        backend.run(qt[:1], (kt, vt), plan, torch.empty_like(qt))
    with pytest.raises(PKVError, match="dtype"):
        backend.run(qt.double(), (kt, vt), plan, torch.empty_like(qt))
    with pytest.raises(PKVError, match="K has shape"):
        backend.run(qt, (kt[:, :8], vt), plan, torch.empty_like(qt))


# -- FlashInfer, vLLM, XQA through stand-in modules -------------------------------------------------
class _FakeWrapper:
    """BatchDecodeWithPagedKVCacheWrapper (FlashInfer 0.6.14) reduced to its documented contract."""

    created: list = []

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        assert kv_layout == "NHD"
        assert float_workspace_buffer.dtype == torch.uint8 and not float_workspace_buffer.any(), "zeroed workspace"
        if use_cuda_graph:
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
        self.use_cuda_graph, self.use_tensor_cores = use_cuda_graph, use_tensor_cores
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.plans = []
        _FakeWrapper.created.append(self)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", q_data_type="float16", kv_data_type=None, **kwargs):
        for t in (indptr, indices, last_page_len):
            assert t.device.type == "cpu" and t.dtype == torch.int32, "host int32 index arrays"
        if self.use_cuda_graph:
            assert len(last_page_len) == len(self.buffers[2]), "graph wrappers have a fixed batch size"
            assert len(indices) <= len(self.buffers[1])
        self.state = (indptr.clone(), indices.clone(), last_page_len.clone(), num_qo_heads, num_kv_heads,
                      head_dim, page_size, q_data_type)
        self.plans.append(self.state)

    def run(self, q, paged_kv_cache, *args, out=None, **kwargs):
        indptr, indices, last, hq, hkv, d, p, dtype = self.state
        k, v = paged_kv_cache
        assert q.dtype == dtype and tuple(k.shape[1:]) == (p, hkv, d) and q.shape[1] == hq
        B = len(last)
        lens = [(int(indptr[i + 1] - indptr[i]) - 1) * p + int(last[i]) for i in range(B)]
        width = max(int(indptr[i + 1] - indptr[i]) for i in range(B))
        table = torch.zeros((B, width), dtype=torch.int32)
        for i in range(B):
            table[i, : int(indptr[i + 1] - indptr[i])] = indices[int(indptr[i]):int(indptr[i + 1])]
        out.copy_(paged_attention(q, k, v, table, lens, 1.0 / math.sqrt(d)).to(out.dtype))
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    _FakeWrapper.created = []
    decode = types.ModuleType("flashinfer.decode")
    decode.BatchDecodeWithPagedKVCacheWrapper = _FakeWrapper
    calls = []

    def trtllm_batch_decode_with_kv_cache(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len,
                                          bmm1_scale=1.0, bmm2_scale=1.0, window_left=-1, out=None,
                                          kv_layout="HND", backend="auto", **kwargs):
        calls.append(dict(kv_layout=kv_layout, backend=backend, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale,
                          max_seq_len=max_seq_len, workspace=workspace_buffer, table=block_tables))
        assert kv_layout == "NHD" and backend == "xqa"
        assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
        k, v = kv_cache
        assert max_seq_len == block_tables.shape[1] * k.shape[1]
        # xqa_batch_decode_with_kv_cache: q_scale = bmm1_scale / (bmm2_scale * o_scale) * sqrt(D), and the
        # kernel scales q.k by q_scale / sqrt(D)
        q_scale = bmm1_scale / bmm2_scale * math.sqrt(query.shape[-1])
        scale = q_scale / math.sqrt(query.shape[-1])
        out.copy_(paged_attention(query, k, v, block_tables, seq_lens, scale).to(out.dtype))
        return out

    decode.trtllm_batch_decode_with_kv_cache = trtllm_batch_decode_with_kv_cache

    def cudnn_batch_decode_with_kv_cache(q, k_cache, v_cache, scale, workspace_buffer, *, max_sequence_kv,
                                         actual_seq_lens_kv=None, block_tables=None, is_cuda_graph_compatible=False,
                                         out=None, **kwargs):
        # flashinfer/cudnn/decode.py: K/V [pages, Hkv, P, D] with any strides, lengths [B, 1, 1, 1]
        calls.append(dict(backend="cudnn", k=k_cache, v=v_cache, scale=scale, workspace=workspace_buffer,
                          max_seq_len=max_sequence_kv, lengths=actual_seq_lens_kv, table=block_tables,
                          graph=is_cuda_graph_compatible, out=out))
        assert block_tables.dtype == torch.int32 and actual_seq_lens_kv.dtype == torch.int32
        assert tuple(actual_seq_lens_kv.shape) == (q.shape[0], 1, 1, 1)
        assert max_sequence_kv == block_tables.shape[1] * k_cache.shape[2]
        k, v = k_cache.permute(0, 2, 1, 3), v_cache.permute(0, 2, 1, 3)  # back to [pages, P, Hkv, D]
        out.copy_(paged_attention(q, k, v, block_tables, actual_seq_lens_kv.reshape(-1), scale).to(out.dtype))
        return out

    decode.cudnn_batch_decode_with_kv_cache = cudnn_batch_decode_with_kv_cache
    package = types.ModuleType("flashinfer")
    package.decode = decode
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.decode", decode)
    return calls


@pytest.fixture
def fake_vllm(monkeypatch):
    calls = {"metadata": [], "run": []}
    fa = types.ModuleType("vllm.vllm_flash_attn")

    def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                               cache_seqlens, qkv_dtype=torch.bfloat16, cu_seqlens_q=None, page_size=None,
                               causal=False, window_size=(-1, -1), num_splits=0, **kwargs):
        calls["metadata"].append(dict(batch_size=batch_size, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                      num_heads_q=num_heads_q, num_heads_kv=num_heads_kv, headdim=headdim,
                                      qkv_dtype=qkv_dtype, page_size=page_size, causal=causal, num_splits=num_splits))
        assert int(cache_seqlens.max()) == max_seqlen_k
        return torch.zeros(1 + 4 * batch_size, dtype=torch.int32)

    def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                               softmax_scale=None, causal=False, block_table=None, out=None,
                               scheduler_metadata=None, fa_version=2, num_splits=0, **kwargs):
        calls["run"].append(dict(fa_version=fa_version, num_splits=num_splits, causal=causal,
                                 has_metadata=scheduler_metadata is not None, max_seqlen_q=max_seqlen_q))
        assert cu_seqlens_k is None and block_table.dtype == torch.int32 and seqused_k.dtype == torch.int32
        assert torch.equal(cu_seqlens_q, torch.arange(q.shape[0] + 1, dtype=torch.int32))
        out.copy_(paged_attention(q, k, v, block_table, seqused_k, softmax_scale).to(out.dtype))
        return out

    fa.get_scheduler_metadata = get_scheduler_metadata
    fa.flash_attn_varlen_func = flash_attn_varlen_func
    interface = types.ModuleType("vllm.vllm_flash_attn.flash_attn_interface")
    interface.FA3_AVAILABLE = True
    fa.flash_attn_interface = interface
    package = types.ModuleType("vllm")
    package.vllm_flash_attn = fa
    monkeypatch.setitem(sys.modules, "vllm", package)
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", fa)
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn.flash_attn_interface", interface)
    return calls


GPU_SPEC = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")
LENGTHS = [1, 15, 16, 17, 150]


def drive(backend, spec=GPU_SPEC, lengths=LENGTHS, seed=5):
    batch, q, k, v = host_case(spec, lengths, hole_fraction=0.4, seed=seed)
    plan = backend.plan(batch)
    qt, kt, vt = (torch.from_numpy(a) for a in (q, k, v))
    out = torch.full(qt.shape, -24576.0, dtype=qt.dtype)
    backend.run(qt, (kt, vt), plan, out)
    return gate(out.numpy(), reference_decode(q, k, v, batch), TOLERANCE[spec.dtype]).max_err, plan, batch


@pytest.mark.parametrize("name", ["flashinfer-cc", "flashinfer-tc"])
def test_flashinfer_adapter_passes_a_correct_step(fake_flashinfer, name):
    backend = registry.create(name, device="cpu")
    err, plan, batch = drive(backend)
    assert err <= TOLERANCE["float32"]
    (wrapper,) = _FakeWrapper.created
    assert wrapper.use_cuda_graph and backend.capabilities.graph == "host"
    assert wrapper.use_tensor_cores == (name == "flashinfer-tc")
    indptr, indices, last, hq, hkv, d, p, _ = wrapper.state
    assert np.array_equal(indptr.numpy(), batch.kv_indptr) and np.array_equal(indices.numpy(), batch.kv_indices)
    assert np.array_equal(last.numpy(), batch.last_page_len) and (hq, hkv, d, p) == (8, 2, 64, 16)


def test_flashinfer_graph_wrappers_per_batch_size_and_stale_plans(fake_flashinfer):
    backend = registry.create("flashinfer-tc", device="cpu")
    drive(backend, lengths=[40, 40])
    drive(backend, lengths=[40, 41])                 # same B, fits: same wrapper
    assert len(_FakeWrapper.created) == 1
    drive(backend, lengths=[4000, 40])               # same B, more pages: a bigger wrapper
    assert len(_FakeWrapper.created) == 2
    drive(backend, lengths=[40, 40, 40])             # another batch size: another wrapper
    assert len(_FakeWrapper.created) == 3
    batch, q, k, v = host_case(GPU_SPEC, [30, 31])
    first = backend.plan(batch)
    backend.plan(batch)                               # re-plans the same wrapper
    qt, kt, vt = (torch.from_numpy(a) for a in (q, k, v))
    with pytest.raises(PKVError, match="stale plan"):
        backend.run(qt, (kt, vt), first, torch.empty_like(qt))


def test_flashinfer_plain_wrapper_is_not_graph_safe(fake_flashinfer):
    backend = registry.create("flashinfer-tc", device="cpu", cuda_graph=False)
    err, _, _ = drive(backend)
    assert err <= TOLERANCE["float32"] and backend.capabilities.graph == "none"
    assert not _FakeWrapper.created[0].use_cuda_graph


def test_vllm_adapter_uses_fa3_scheduler_metadata_and_the_graph_split_cap(fake_vllm):
    backend = registry.create("vllm-fa3", device="cpu")
    err, plan, batch = drive(backend)
    assert err <= TOLERANCE["float32"]
    (meta,) = fake_vllm["metadata"]
    assert meta == dict(batch_size=5, max_seqlen_q=1, max_seqlen_k=150, num_heads_q=8, num_heads_kv=2, headdim=64,
                        qkv_dtype=torch.float32, page_size=16, causal=True, num_splits=32)
    (run,) = fake_vllm["run"]
    assert run == dict(fa_version=3, num_splits=32, causal=True, has_metadata=True, max_seqlen_q=1)
    assert tuple(plan.block_table.shape) == (5, 10)


def test_xqa_adapter_reads_nhd_in_place_with_plain_softmax_scale(fake_flashinfer):
    backend = registry.create("trtllm-xqa", device="cpu", workspace_bytes=1 << 20)
    err, plan, batch = drive(backend)
    assert err <= TOLERANCE["float32"]
    (call,) = fake_flashinfer
    assert call["kv_layout"] == "NHD" and call["backend"] == "xqa"
    assert call["bmm1_scale"] == pytest.approx(1 / 8) and call["bmm2_scale"] == 1.0
    assert call["workspace"].dtype == torch.uint8 and not call["workspace"].any()


def test_cudnn_adapter_reads_the_nhd_cache_as_an_hnd_view_without_a_copy(fake_flashinfer):
    backend = registry.create("flashinfer-cudnn", device="cpu", workspace_bytes=1 << 20)
    assert backend.capabilities.graph == "device" and backend.capabilities.kv_dtypes == ()
    batch, q, k, v = host_case(GPU_SPEC, LENGTHS, hole_fraction=0.4, seed=5)
    plan = backend.plan(batch)
    qt, kt, vt = (torch.from_numpy(a) for a in (q, k, v))
    out = torch.full(qt.shape, -24576.0, dtype=qt.dtype)
    backend.run(qt, (kt, vt), plan, out)
    assert gate(out.numpy(), reference_decode(q, k, v, batch), TOLERANCE[GPU_SPEC.dtype]).passed
    (call,) = fake_flashinfer
    assert call["backend"] == "cudnn" and call["graph"] and call["out"] is out
    # the same bytes: a permuted view of K and V, never a copy
    assert call["k"].data_ptr() == kt.data_ptr() and call["v"].data_ptr() == vt.data_ptr()
    assert tuple(call["k"].shape) == (batch.num_pages, GPU_SPEC.num_kv_heads, GPU_SPEC.page_size, GPU_SPEC.head_dim)
    assert call["scale"] == pytest.approx(1 / math.sqrt(GPU_SPEC.head_dim))
    assert call["workspace"].numel() == 1 << 20


def test_cudnn_plan_for_the_reservation_follows_lengths_by_update_lengths(fake_flashinfer):
    """A plan made for whole pages and told shorter lengths on the device computes what a plan
    made for those lengths computes (the captured step's contract, capabilities.graph 'device')."""
    backend = registry.create("flashinfer-cudnn", device="cpu", workspace_bytes=1 << 20)
    full, q, k, v = host_case(GPU_SPEC, [64, 64, 64], hole_fraction=0.4, seed=9)
    plan = backend.plan(full)
    plan.update_lengths(torch.tensor([50, 17, 64], dtype=torch.int32))
    qt, kt, vt = (torch.from_numpy(a) for a in (q, k, v))
    out = torch.empty_like(qt)
    backend.run(qt, (kt, vt), plan, out)
    want = paged_attention(qt, kt, vt, torch.from_numpy(full.padded_block_table()), [50, 17, 64],
                           1 / math.sqrt(GPU_SPEC.head_dim))
    assert gate(out.numpy(), want.numpy(), GPU_SPEC.dtype).passed


def test_cudnn_says_what_it_does_not_run_before_any_launch():
    backend = registry.create("flashinfer-cudnn", device="cpu")
    fp8_spec = AttentionSpec(dtype="float16", kv_dtype="float8_e4m3")
    assert any("float8_e4m3" in r and "cuDNN" in r for r in backend.unavailable(fp8_spec))
    assert any("float32" in r for r in backend.unavailable(AttentionSpec(dtype="float32")))


# -- FP8 KV caches (kv_dtype float8_e4m3): torch-sdpa for real, the GPU adapters through the fakes --------
from persistentkv import fp8  # noqa: E402

FP8_BASELINES = ("torch-sdpa", "flashinfer-cc", "flashinfer-tc", "trtllm-xqa", "vllm-fa3")


def fp8_case(spec: AttentionSpec, lengths, per_head: bool, seed=0, hole_fraction=0.4):
    """(batch, q, cache, (k64, v64)): a fresh random FP8 cache (codes from fp8.quantize with scales
    fitted per tensor or per KV head; K and V of different magnitudes), q of spec.dtype, the cache
    as the backends take it (K, V float8_e4m3fn, k_scale, v_scale float32) and its dequantised
    float64 values (fp8.dequantize of the codes), which the reference reads."""
    batch = make_batch(spec, lengths, hole_fraction=hole_fraction, seed=seed)
    rng = np.random.default_rng(seed + 23)
    shape = (batch.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    head_gain = np.geomspace(0.5, 2.0, spec.num_kv_heads).reshape(1, 1, -1, 1)  # per-head scales differ
    k = rng.standard_normal(shape) * head_gain
    v = rng.standard_normal(shape) * head_gain
    axis = 2 if per_head else None
    ks, vs = fp8.fit_scale(k, head_axis=axis), fp8.fit_scale(v, head_axis=axis)
    kc, vc = fp8.quantize(k, ks, head_axis=2), fp8.quantize(v, vs, head_axis=2)
    dtype = {"float16": np.float16, "float32": np.float32}.get(spec.dtype, np.float32)
    q = rng.standard_normal((batch.batch_size, spec.num_qo_heads, spec.head_dim)).astype(dtype)
    qt = torch.from_numpy(q).to(getattr(torch, spec.dtype))
    cache = (torch.from_numpy(kc).view(torch.float8_e4m3fn), torch.from_numpy(vc).view(torch.float8_e4m3fn),
             torch.from_numpy(ks), torch.from_numpy(vs))
    # what the backends read, dequantised as the project does it (codes = k.view(torch.uint8))
    k64 = fp8.dequantize(cache[0].view(torch.uint8).numpy(), ks, head_axis=2)
    v64 = fp8.dequantize(cache[1].view(torch.uint8).numpy(), vs, head_axis=2)
    return batch, qt, cache, (k64, v64)


@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
@pytest.mark.parametrize("dtype,group_size", [("float16", 4), ("float32", 1), ("float32", 8), ("bfloat16", 2)])
def test_sdpa_reads_an_fp8_cache_within_the_query_dtype_tolerance(dtype, group_size, per_head):
    spec = AttentionSpec(num_qo_heads=4 * group_size, num_kv_heads=4, head_dim=64, page_size=16, dtype=dtype,
                         kv_dtype="float8_e4m3")
    backend = registry.create("torch-sdpa", device="cpu")
    assert backend.unavailable(spec) == []
    batch, q, cache, (k64, v64) = fp8_case(spec, [1, 15, 16, 17, 97, 300], per_head, seed=group_size)
    plan = backend.plan(batch)
    assert plan.k_buf.dtype == torch.uint8 and plan.k_deq.dtype == q.dtype
    out = torch.full(q.shape, -24576.0, dtype=q.dtype)
    backend.run(q, cache, plan, out)
    ref = reference_decode(q.double().numpy(), k64, v64, batch)
    verdict = gate(out.double().numpy(), ref, TOLERANCE[dtype], batch.seq_lens)
    assert verdict.passed, verdict.describe()
    # the scales matter: the same codes read with scale 1 are far off
    ones = torch.ones_like(cache[2])
    backend.run(q, (cache[0], cache[1], ones, ones), plan, out)
    assert gate(out.double().numpy(), ref, TOLERANCE[dtype]).max_err > 0.1


def test_sdpa_fp8_plan_follows_new_scale_values_and_lengths():
    """The scales are read on the device at each run (a new value in the same tensor is used), and
    update_lengths works as for any cache."""
    spec = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32",
                         kv_dtype="float8_e4m3")
    backend = registry.create("torch-sdpa", device="cpu")
    batch, q, cache, (k64, v64) = fp8_case(spec, [64, 64, 64], per_head=True, hole_fraction=0.0)
    plan = backend.plan(batch)
    lengths = torch.tensor([50, 17, 64], dtype=torch.int32)
    plan.update_lengths(lengths)
    cache[3].mul_(2.0)
    out = torch.empty_like(q)
    backend.run(q, cache, plan, out)
    want = paged_attention(q, torch.from_numpy(k64), torch.from_numpy(2.0 * v64),
                           torch.from_numpy(batch.padded_block_table()), [50, 17, 64], 1 / math.sqrt(64))
    assert_gated(out.numpy(), want.numpy(), "float32")


FP8_SPEC = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32",
                         kv_dtype="float8_e4m3")


def test_step_tensor_checks_refuse_bad_fp8_caches_with_one_line():
    from persistentkv.backends.torch_sdpa import check_step_tensors

    batch, q, cache, _ = fp8_case(FP8_SPEC, [40, 7], per_head=False)
    k, v, ks, vs = cache
    out = torch.empty_like(q)

    def refused(c, match):
        with pytest.raises(PKVError, match=match) as info:
            check_step_tensors(FP8_SPEC, 2, q, c, out, "who")
        assert "\n" not in str(info.value) and str(info.value).startswith("who: ")

    check_step_tensors(FP8_SPEC, 2, q, cache, out, "who")                                 # accepted
    check_step_tensors(FP8_SPEC, 2, q, (k, v, ks.reshape(()), torch.ones(2)), out, "who")  # [] and [Hkv]
    refused((k, v), r"an FP8 cache \(kv_dtype float8_e4m3\) is \(K, V, k_scale, v_scale\), got a tuple of 2")
    refused((k, v, ks, torch.ones(3)), r"v_scale must be a contiguous float32 tensor of 1 or 2 \(num_kv_heads\) "
                                       r"values on cpu, got torch.float32 \[3\] on cpu")
    refused((k, v, ks.double(), vs), r"k_scale must be a contiguous float32 tensor .* got torch.float64 \[1\]")
    refused((k, v, torch.ones(2, 1), vs), r"k_scale must be .* got torch.float32 \[2, 1\]")
    refused((k, v, torch.ones(4)[::2], vs), r"k_scale must be a contiguous")
    refused((k, v, 1.0, vs), r"k_scale must be .* got float")
    refused((k.view(torch.uint8).view(torch.float8_e5m2), v, ks, vs),
            r"K has dtype torch.float8_e5m2, expected torch.float8_e4m3fn \(e5m2 caches are not supported\)")
    refused((k.to(torch.float16), v.to(torch.float16), ks, vs),
            r"K has dtype torch.float16, expected torch.float8_e4m3fn \(the spec's kv_dtype is float8_e4m3\)")
    refused((k[:, :8], v, ks, vs), r"K has shape")
    with pytest.raises(PKVError, match=r"q has dtype torch.float16, expected torch.float32") as info:
        check_step_tensors(FP8_SPEC, 2, q.half(), cache, out, "who")
    # and a cache of the query's dtype refuses the scales with a hint
    plain = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")
    kf, vf = k.float(), v.float()
    with pytest.raises(PKVError, match=r"cache must be a \(K, V\) pair, got a tuple of 4; \(K, V, k_scale, "
                                       r"v_scale\) is for an FP8 cache") as info:
        check_step_tensors(plain, 2, q, (kf, vf, ks, vs), out, "who")
    assert "\n" not in str(info.value)


def test_sdpa_run_refuses_bad_fp8_inputs_with_one_line():
    backend = registry.create("torch-sdpa", device="cpu")
    batch, q, (k, v, ks, vs), _ = fp8_case(FP8_SPEC, [40, 7], per_head=False)
    plan = backend.plan(batch)
    for cache, match in (((k, v, ks, torch.ones(3)), "v_scale must be"),
                         ((k.to(torch.float32), v.to(torch.float32), ks, vs), "K has dtype torch.float32"),
                         ((k, v), "is \\(K, V, k_scale, v_scale\\)")):
        with pytest.raises(PKVError, match=match) as info:
            backend.run(q, cache, plan, torch.empty_like(q))
        assert "\n" not in str(info.value) and str(info.value).startswith("torch-sdpa: ")


def test_fp8_capabilities_and_unavailable_reasons():
    for name in FP8_BASELINES:
        assert registry.create(name).capabilities.kv_dtypes == ("float8_e4m3",), name
    bf16 = AttentionSpec(dtype="bfloat16", kv_dtype="float8_e4m3")
    fp16 = AttentionSpec(dtype="float16", kv_dtype="float8_e4m3")
    for spec in (bf16, fp16):
        result = registry.available(spec, list(FP8_BASELINES))
        for name, reasons in result.items():
            assert not any("does not read" in r for r in reasons), (name, reasons)
    assert registry.available(bf16, ["torch-sdpa"])["torch-sdpa"] == []
    reasons = registry.create("vllm-fa3").unavailable(fp16)
    assert any("writes bfloat16 only" in r and "float16" in r for r in reasons), reasons
    assert not any("bfloat16 only" in r for r in registry.create("vllm-fa3").unavailable(bf16))
    native = registry.create("trtllm-native").unavailable(bf16)
    assert native and all(isinstance(r, str) and r for r in native)


def test_host_scales_read_once_per_version_and_refuse_per_head_values():
    from persistentkv.backends.flashinfer_backend import HostScales

    scales = HostScales("fi", "one scale per tensor")
    ks, vs = torch.tensor([0.5]), torch.full((2,), 0.25)       # [Hkv] of equal values: one scale
    assert scales.pair(ks, vs) == (0.5, 0.25)
    ks.fill_(2.0)                                               # an in-place write: read again
    assert scales.pair(ks, vs) == (2.0, 0.25)
    with pytest.raises(PKVError, match=r"fi: per-KV-head k_scale \(2 distinct values\) is not supported: one "
                                       r"scale per tensor") as info:
        scales.value("k_scale", torch.tensor([1.0, 2.0]))
    assert "\n" not in str(info.value)
    with pytest.raises(PKVError, match="v_scale must be finite and > 0"):
        scales.value("v_scale", torch.tensor([0.0]))


def test_host_scales_remember_the_memory_not_the_view_object():
    """A decode loop hands run() fresh views of its [L, 2, 1] scales at every call (a GPU capture
    after an eager step raised 'not read before this capture' when the memo keyed the view object)."""
    from persistentkv.backends.flashinfer_backend import HostScales

    scales = HostScales("fi", "one scale per tensor")
    table = torch.tensor([[[0.5], [0.25]], [[2.0], [4.0]]])   # [L=2, 2, 1]
    assert scales.pair(table[1, 0], table[1, 1]) == (2.0, 4.0)
    table.data[1, 0] = 8.0              # a write torch does not count (no version bump) ...
    assert scales.value("k_scale", table[1, 0]) == 2.0        # ... so a fresh view finds the memo: not read again
    table[1, 0] = 3.0                   # an in-place write through another view bumps the shared version
    assert scales.value("k_scale", table[1, 0]) == 3.0
    assert scales.pair(table[0, 0], table[0, 1]) == (0.5, 0.25)  # other memory, other keys
    assert scales.value("k_scale", table[1:, 0].reshape(-1)) == 3.0


# the stand-ins, extended to the FP8 arguments each library documents --------------------------------------
class _FakeFp8Wrapper(_FakeWrapper):
    """FlashInfer 0.6.14's wrapper with an FP8 cache: plan(kv_data_type=float8_e4m3fn) and
    run(k_scale=float, v_scale=float): sm_scale *= k_scale, then out *= v_scale (decode.py)."""

    def plan(self, *args, kv_data_type=None, **kwargs):
        super().plan(*args, **kwargs)
        self.kv_data_type = kv_data_type

    def run(self, q, paged_kv_cache, *args, k_scale=None, v_scale=None, out=None, **kwargs):
        k, v = paged_kv_cache
        assert k.dtype == v.dtype == self.kv_data_type == torch.float8_e4m3fn
        assert isinstance(k_scale, float) and isinstance(v_scale, float)
        self.scales = (k_scale, v_scale)
        super().run(q, (k.double() * k_scale, v.double()), out=out)  # k_scale folded into the scores
        out *= v_scale
        return out


@pytest.mark.parametrize("name", ["flashinfer-cc", "flashinfer-tc"])
def test_flashinfer_adapter_passes_an_fp8_step(fake_flashinfer, monkeypatch, name):
    import flashinfer.decode as decode

    monkeypatch.setattr(decode, "BatchDecodeWithPagedKVCacheWrapper", _FakeFp8Wrapper)
    backend = registry.create(name, device="cpu")
    batch, q, cache, (k64, v64) = fp8_case(FP8_SPEC, LENGTHS, per_head=False, seed=5)
    plan = backend.plan(batch)
    out = torch.full(q.shape, -24576.0, dtype=q.dtype)
    backend.run(q, cache, plan, out)
    assert_gated(out.numpy(), reference_decode(q.numpy(), k64, v64, batch), "float32")
    wrapper = _FakeWrapper.created[-1]
    assert wrapper.kv_data_type == torch.float8_e4m3fn and wrapper.state[-1] == torch.float32  # q stays
    assert wrapper.scales == (float(cache[2]), float(cache[3]))
    per_head = (cache[0], cache[1], torch.tensor([1.0, 2.0]), cache[3])
    with pytest.raises(PKVError, match="FlashInfer takes one K and one V scale per tensor"):
        backend.run(q, per_head, plan, out)


def test_xqa_adapter_passes_fp8_scales_as_bmm_scales(fake_flashinfer):
    backend = registry.create("trtllm-xqa", device="cpu", workspace_bytes=1 << 20)
    batch, q, cache, (k64, v64) = fp8_case(FP8_SPEC, LENGTHS, per_head=False, seed=6)
    plan = backend.plan(batch)
    out = torch.full(q.shape, -24576.0, dtype=q.dtype)
    import flashinfer.decode as decode

    real = decode.trtllm_batch_decode_with_kv_cache

    def fp8_xqa(query, kv_cache, *args, **kwargs):
        k, v = kv_cache
        assert k.dtype == v.dtype == torch.float8_e4m3fn and query.dtype == q.dtype  # the query as given
        assert isinstance(kwargs["bmm1_scale"], float) and isinstance(kwargs["bmm2_scale"], float)
        # XQA: one kv_scale (= bmm2_scale) for K and V; the scores are scaled by bmm1_scale
        out = real(query, (k.double(), v.double() * kwargs["bmm2_scale"]), *args, **{
            **kwargs, "bmm2_scale": 1.0})
        return out

    decode.trtllm_batch_decode_with_kv_cache = fp8_xqa
    backend.run(q, cache, plan, out)
    assert_gated(out.numpy(), reference_decode(q.numpy(), k64, v64, batch), "float32")
    call = fake_flashinfer[-1]
    assert call["bmm1_scale"] == pytest.approx(float(cache[2]) / 8)
    with pytest.raises(PKVError, match=r"trtllm-xqa: per-KV-head k_scale .* XQA takes one K and one V scale"):
        backend.run(q, (cache[0], cache[1], torch.tensor([1.0, 2.0]), cache[3]), plan, out)


def test_vllm_adapter_quantises_the_query_and_passes_descales(fake_vllm, monkeypatch):
    spec = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="bfloat16",
                         kv_dtype="float8_e4m3")
    backend = registry.create("vllm-fa3", device="cpu")
    batch, q, cache, (k64, v64) = fp8_case(spec, LENGTHS, per_head=True, seed=7)
    q[0, 0, 0] = 1000.0  # beyond e4m3: clamped to 448 as vLLM's QuantFP8 does, never NaN
    import vllm.vllm_flash_attn as fa

    real = fa.flash_attn_varlen_func
    seen = {}

    def fp8_fa3(q, k, v, *args, q_descale=None, k_descale=None, v_descale=None, out=None, **kwargs):
        assert q.dtype == k.dtype == v.dtype == torch.float8_e4m3fn and out.dtype == torch.bfloat16
        B, Hkv = q.shape[0], k.shape[2]
        for d in (q_descale, k_descale, v_descale):
            assert tuple(d.shape) == (B, Hkv) and d.dtype == torch.float32
        seen.update(q=q.clone(), q_descale=q_descale, k_descale=k_descale)
        G = q.shape[1] // Hkv
        qd = q.double() * q_descale.repeat_interleave(G, dim=1)[:, :, None]
        kd = k.double() * k_descale[0].view(1, 1, -1, 1)
        vd = v.double() * v_descale[0].view(1, 1, -1, 1)
        return real(qd, kd, vd, *args, out=out, **kwargs)

    monkeypatch.setattr(fa, "flash_attn_varlen_func", fp8_fa3)
    plan = backend.plan(batch)
    assert fake_vllm["metadata"][-1]["qkv_dtype"] == torch.float8_e4m3fn
    out = torch.full(q.shape, -24576.0, dtype=q.dtype)
    backend.run(q, cache, plan, out)
    q8 = seen["q"].double()
    assert q8[0, 0, 0] == 448.0 and torch.equal(q8, q.float().clamp(-448, 448).to(torch.float8_e4m3fn).double())
    assert torch.equal(seen["q_descale"], torch.ones(5, 2))
    assert seen["k_descale"].data_ptr() == cache[2].data_ptr() and seen["k_descale"].stride() == (0, 1)  # a view
    # against float64 with the query the kernel was given (its e4m3 rounding is FA3's, not the adapter's)
    assert_gated(out.float().numpy(), reference_decode(q8.numpy(), k64, v64, batch), "bfloat16")
