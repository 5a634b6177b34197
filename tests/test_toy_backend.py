"""A backend written outside the package, exactly as persistentkv.backends.base documents it.

The toy computes decode attention in plain torch on the CPU from the block table: a class with
``name``, ``capabilities``, ``unavailable``, ``plan`` and ``run`` (its plans have
``update_lengths`` when it declares ``graph="device"``), registered with
``registry.register``. It then runs through the measurement harness and through the decode loop,
which must treat it by what it declares alone:

* the harness gives a ``graph="none"`` toy ``unavailable`` kernel rows and times the rest, a
  ``host_arrays`` toy gets the host-only reason, any other toy every protocol;
* the decode loop plans a ``graph="device"`` toy once for the reserved pages and calls
  ``plan.update_lengths`` every step (without that call the toy would attend over the whole
  reservation and its logits would be wrong), re-plans a ``graph="replan"`` toy every step, hands
  a ``host_arrays`` toy NumPy arrays, and refuses to capture a ``graph="none"`` one; in every
  case the logits equal the loop's with torch-sdpa.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from persistentkv.backends import registry
from persistentkv.backends.base import GRAPH_MODES, Backend, Capabilities
from persistentkv.cache import make_batch, random_cache, random_queries
from persistentkv.errors import PKVError
from persistentkv.reference import reference_decode, relative_error
from persistentkv.spec import AttentionSpec

torch = pytest.importorskip("torch")


class ToyPlan:
    """The toy's step: the padded block table and each row's length (torch, on the CPU)."""

    def __init__(self, table, lengths):
        self.table, self.lengths = table, lengths
        self.updates = 0

    def update_lengths(self, lengths) -> None:
        self.lengths.copy_(lengths)
        self.updates += 1


class ToyBackend:
    """Gather every page of the block table, mask keys at or past each row's length, softmax."""

    def __init__(self, name: str = "toy", graph: str = "device", host_arrays: bool = False):
        self.name = name
        self.capabilities = Capabilities(dtypes=("float32", "float64"), graph=graph, host_arrays=host_arrays)
        self.plans: list[ToyPlan] = []

    def unavailable(self, spec: AttentionSpec) -> list[str]:
        return self.capabilities.shape_reasons(spec, "the toy")

    def plan(self, batch) -> ToyPlan:
        plan = ToyPlan(torch.from_numpy(batch.padded_block_table().astype(np.int64)),
                       torch.from_numpy(batch.seq_lens.astype(np.int32)))
        self.plans.append(plan)
        return plan

    def run(self, q, cache, plan: ToyPlan, out) -> None:
        k_cache, v_cache = cache
        if self.capabilities.host_arrays:
            assert all(isinstance(a, np.ndarray) for a in (q, k_cache, v_cache, out))
            q, k_cache, v_cache, result = (torch.from_numpy(a) for a in (q, k_cache, v_cache, out))
        else:
            assert all(isinstance(t, torch.Tensor) for t in (q, k_cache, v_cache, out))
            result = out
        B, Hq, D = q.shape
        _, P, Hkv, _ = k_cache.shape
        W = plan.table.shape[1]
        k = k_cache[plan.table].reshape(B, W * P, Hkv, D)
        v = v_cache[plan.table].reshape(B, W * P, Hkv, D)
        scores = torch.einsum("bhgd,blhd->bhgl", q.reshape(B, Hkv, Hq // Hkv, D), k) / math.sqrt(D)
        keep = torch.arange(W * P)[None, :] < plan.lengths[:, None].long()
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
        o = torch.einsum("bhgl,blhd->bhgd", torch.softmax(scores, dim=-1), v)
        result.copy_(o.reshape(B, Hq, D))


#: name -> what the toy of that name declares
TOYS = {"toy": {}, "toy-replan": {"graph": "replan"}, "toy-eager": {"graph": "none"},
        "toy-host": {"graph": "none", "host_arrays": True}}


@pytest.fixture()
def toys():
    """Every toy registered the documented way, and unregistered after the test."""
    for name, declared in TOYS.items():
        registry.register(name, lambda name=name, declared=declared, **options: ToyBackend(name, **declared, **options))
    try:
        yield
    finally:
        for name in TOYS:
            registry.unregister(name)


def test_the_toy_is_a_backend_and_computes_decode_attention(toys):
    spec = AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="float64")
    backend = registry.create("toy")
    assert isinstance(backend, Backend) and backend.capabilities.graph in GRAPH_MODES
    assert "toy" in registry.names() and backend.unavailable(spec) == []
    assert backend.unavailable(AttentionSpec(dtype="float16")) == ["the toy supports dtype float32, float64, "
                                                                   "not float16"]
    batch = make_batch(spec, [40, 17, 300], 0.5, 1)
    k, v = random_cache(spec, batch.num_pages, 1)
    q = random_queries(spec, batch.batch_size, 1)
    out = torch.zeros(q.shape, dtype=torch.float64)
    backend.run(torch.from_numpy(q), (torch.from_numpy(k), torch.from_numpy(v)), backend.plan(batch), out)
    assert relative_error(out.numpy(), reference_decode(q, k, v, batch)) < 1e-12


def test_register_refuses_taken_names_and_unregister_unknown_ones(toys):
    with pytest.raises(PKVError, match="one of the package's own"):
        registry.register("numpy", ToyBackend)
    with pytest.raises(PKVError, match="registered already"):
        registry.register("toy", ToyBackend)
    registry.register("toy", lambda **o: ToyBackend("toy", graph="replan"), replace=True)
    assert registry.create("toy").capabilities.graph == "replan"
    with pytest.raises(PKVError, match="not added by register"):
        registry.unregister("numpy")


# -- (a) through the measurement harness, on torch's CPU device ---------------------------------------
def test_the_harness_measures_the_toy_by_its_declared_capabilities(toys):
    from persistentkv.measure import workload
    from persistentkv.measure.device import TorchDevice
    from persistentkv.measure.harness import BackendFactory, RunContext, Settings, run_case
    from persistentkv.measure.rows import raw_frame

    spec = AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")
    case = workload.synthetic_case("t", "c", [33, 70], spec, tuple(workload.Variant(n) for n in TOYS))
    rows = run_case(case, TorchDevice("cpu", l2_bytes=0), BackendFactory(), Settings(layers=2, repeats=2, warmup=1),
                    RunContext("r", log=lambda m: None))
    frame = raw_frame(rows)
    toy = frame[frame["backend"] == "toy"]
    assert (toy["status"] == "ok").all() and sorted(set(toy["protocol"])) == ["eager", "kernel", "published", "step"]
    assert len(toy) == 4 * 2 and (toy["route"] == "toy").all() and (toy["time_us"] > 0).all()
    replan = frame[frame["backend"] == "toy-replan"]
    assert (replan["status"] == "ok").all() and len(replan) == 4 * 2
    eager = frame[frame["backend"] == "toy-eager"]
    kernel = eager[eager["protocol"] == "kernel"]
    assert len(kernel) == 1 and (kernel["status"] == "unavailable").all()   # one row per case
    assert kernel["reason"].str.contains("capabilities.graph = 'none'").all()
    assert (eager[eager["protocol"] != "kernel"]["status"] == "ok").all() and len(eager) == 1 + 3 * 2
    host = frame[frame["backend"] == "toy-host"]
    assert host["status"].tolist() == ["unavailable"] and "NumPy arrays on the host" in host["reason"].iloc[0]


# -- (b) through the decode loop, on the CPU --------------------------------------------------------
STEPS = 12


def decode(backend, steps: int = STEPS):
    """Logits [steps + 1, B, V] of the config's tiny model: a ragged prefill on scattered pages,
    then ``steps`` greedy steps; and the loop."""
    from persistentkv import configuration
    from persistentkv.model import DecodeLoop, Model, PagedKV, model_shape, random_weights

    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    shape = model_shape(configuration.load_config(root / "config" / "config.yaml", base_dir=root), "tiny")
    weights = random_weights(shape, torch.float32, "cpu", seed=7)
    loop = DecodeLoop(Model(shape, weights), PagedKV(shape, 64, 4, torch.float32, "cpu", seed=5), backend)
    rng = np.random.default_rng(3)
    with torch.no_grad():
        logits = [torch.stack([loop.prefill(rid, rng.integers(0, shape.vocab_size, n), reserve=n + steps + 3)
                               for rid, n in enumerate((5, 11, 17))])]
        for _ in range(steps):
            logits.append(loop.step().clone())
    return torch.stack(logits), loop


@pytest.fixture(scope="module")
def sdpa_logits():
    return decode("torch-sdpa")[0]


def close(ours, want) -> float:
    scale = want.abs().amax(dim=-1, keepdim=True)
    return float(((ours - want).abs() / scale).max())


def test_a_device_toy_is_planned_once_and_follows_the_lengths_by_update_lengths(toys, sdpa_logits):
    logits, loop = decode("toy")
    assert close(logits, sdpa_logits) <= 1e-5
    assert loop.mode == "device" and loop.replans == 1
    (plan,) = loop.backend.plans       # planned once, for the reserved pages
    assert plan.table.shape[1] == max(-(-(n + STEPS + 3) // 4) for n in (5, 11, 17))
    assert plan.updates == STEPS       # and told the lengths at every step
    assert plan.lengths.tolist() == [n + STEPS for n in (5, 11, 17)]


def test_a_replan_toy_is_planned_at_every_step(toys, sdpa_logits):
    logits, loop = decode("toy-replan")
    assert close(logits, sdpa_logits) <= 1e-5
    assert loop.mode == "replan" and all(p.updates == 0 for p in loop.backend.plans)
    assert len(loop.backend.plans) == 1 + STEPS   # the reservation's (sizing), then one per step


def test_a_host_arrays_toy_gets_numpy_arrays_and_a_graph_none_toy_is_not_captured(toys, sdpa_logits):
    logits, loop = decode("toy-host")
    assert close(logits, sdpa_logits) <= 1e-5
    assert loop.mode == "replan"
    with pytest.raises(PKVError, match="not graph-safe"):
        loop.capture()
