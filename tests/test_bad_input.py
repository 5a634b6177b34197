"""Bad input through the public API and the CLI: the table of what each now says.

CASES below is the table, grouped by what the input did before it was refused here: a silent
wrong answer, accepted where it should be refused, a hang, or a raw exception from deep inside.
Each row names the function (or command), the bad value and the exact one-line message now given
(a PKVError, or the CLI's ``error: ...`` line with exit status 2); every row runs within
ROW_SECONDS. docs/BAD_INPUT.md is this table, printed by running this file::

    python tests/test_bad_input.py > docs/BAD_INPUT.md

and a test holds the committed page equal to it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import yaml

from bounded import within
from persistentkv import cli, configuration
from persistentkv.backends.numpy_backend import NumpyBackend
from persistentkv.cache import (
    MAX_ALLOCATION_PAGES, MAX_PAGES, Batch, allocate, batch_for_step, make_batch, random_cache, random_queries,
)
from persistentkv.errors import PKVError
from persistentkv.plan import make_plan
from persistentkv.reference import execute_plan, reference_decode, relative_error
from persistentkv.spec import MAX_SEQ_LEN, AttentionSpec
from persistentkv.traces import (
    MAX_TRACE_REQUESTS, MAX_TRACE_ROWS, Request, Step, Trace, TorchCompatibleRNG, active_steps, build, from_file,
    generate, read_trace,
)

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "BAD_INPUT.md"
#: No row may take longer (a hang fails the row instead of stalling the suite).
ROW_SECONDS = 30

#: What the input did before, in the order the page lists the groups.
KINDS = {
    "silent": "Silent wrong answers (a result, and no error)",
    "accepted": "Accepted where they should be refused",
    "hang": "Hangs (never returned, or ran for minutes)",
    "raw": "Raw exceptions from deep inside (TypeError, ValueError, KeyError, MemoryError, ...)",
}


@dataclass(frozen=True)
class Bad:
    kind: str                   # a key of KINDS
    function: str               # what a user calls
    value: str                  # the bad value, as the page shows it
    call: Callable[[], object]  # raises the PKVError (API) or returns the CLI's argv
    message: str                # the one line now given
    cli: bool = False

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.function}-{self.value}".replace(" ", "_")


# ---- small inputs the rows share (made once, in memory) -----------------------------------------

SPEC = AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=4, dtype="float32")
OK = make_batch(SPEC, [5, 9])
K, V = random_cache(SPEC, OK.num_pages, 0)
Q = random_queries(SPEC, OK.batch_size, 0)
PLAN = make_plan(OK, "split", num_splits=2)
ALLOCATION = allocate((Request(0, 0, 5, 1), Request(1, 0, 9, 1)), 4, 0.0, 0)
HEADER = "request_id,arrival_step,prompt_len,decode_steps\n"
GOOD_TRACE = generate("uniform", 1, 4, 2, 3)


def batch(**change) -> Batch:
    fields = dict(spec=SPEC, seq_lens=OK.seq_lens, kv_indptr=OK.kv_indptr, kv_indices=OK.kv_indices,
                  num_pages=OK.num_pages)
    return Batch(**{**fields, **change})


def execute(out=None, plan=PLAN, q=Q, k=K, v=V):
    return execute_plan(plan, q, k, v, OK, out=out)


def csv(rows: str) -> Path:
    """t.csv in the current folder (each row runs in its own empty folder)."""
    path = Path("t.csv")
    path.write_text(HEADER + rows)
    return path


def trace_json(edit) -> Path:
    """t.json: GOOD_TRACE as its file holds it, changed by ``edit(data)``."""
    data = json.loads(GOOD_TRACE.to_json())
    edit(data)
    path = Path("t.json")
    path.write_text(json.dumps(data))
    return path


def torch_or_skip():
    return pytest.importorskip("torch", reason="torch-sdpa rows need torch")


def sdpa(device="cpu"):
    from persistentkv.backends.torch_sdpa import TorchSdpaBackend

    torch_or_skip()
    return TorchSdpaBackend(device=device)


def sdpa_run(q=None, pages=None):
    """torch-sdpa's run() on OK with CPU tensors: ``q`` in place of Q's, the cache cut to ``pages``."""
    torch = torch_or_skip()
    backend = sdpa()
    tq = torch.from_numpy(Q)
    cache = tuple(torch.from_numpy(a[:pages]) for a in (K, V))
    backend.run(tq if q is None else q, cache, backend.plan(OK), torch.zeros_like(tq))


def reasons_of(backend) -> None:
    """What ``unavailable`` says for SPEC, as the error a caller would raise."""
    reasons = backend.unavailable(SPEC)
    if reasons:
        raise PKVError("; ".join(reasons))


def numpy_run(q=Q, cache=(K, V), plan=None, out=None):
    backend = NumpyBackend("split", num_splits=2)
    backend.run(q, cache, backend.plan(OK) if plan is None else plan, out)


def file_with(name: str, data: bytes) -> Path:
    path = Path(name)
    path.write_bytes(data)
    return path


def config_with(edit) -> dict:
    """The committed config, changed by ``edit(config)``, validated."""
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    edit(config)
    return configuration.validate_config(config, ROOT)


CASES: list[Bad] = [
    # ---- silent wrong answers -------------------------------------------------------------------
    Bad("silent", "cache.Batch", "kv_indices + 0.9, float (1.9 read as page 1)",
        lambda: batch(kv_indices=OK.kv_indices + 0.9),
        'kv_indices (page ids) must be integers, got float64 values such as 1.9'),
    Bad("silent", "cache.Batch", "num_pages 2**33, kv_indices 2**32 + 3 (read as page 3)",
        lambda: batch(kv_indices=OK.kv_indices.astype(np.int64) + 2**32, num_pages=2**33),
        'num_pages must be an integer in [1, 2147483648], got 8589934592'),
    Bad("silent", "cache.Batch", "kv_indptr float",
        lambda: batch(kv_indptr=OK.kv_indptr + 0.5),
        'kv_indptr must be integers, got float64 values such as 0.5'),
    Bad("silent", "cache.Batch", "seq_lens uint64 2**64 - 1",
        lambda: batch(seq_lens=np.array([5, 2**64 - 1], dtype=np.uint64)),
        'seq_lens[1] = 18446744073709551615 is out of range [1, 2147483520]'),
    Bad("silent", "cache.batch_for_step", "Step with 2 request ids and 1 length (a row dropped)",
        lambda: batch_for_step(SPEC, ALLOCATION, Step(0, (0, 1), (5,))),
        'step 0 needs one length per request id and at least one row, got 2 ids and 1 lengths'),
    Bad("silent", "cache.allocate", "two requests with id 0 (the first one's pages lost)",
        lambda: allocate((Request(0, 0, 5, 1), Request(0, 0, 9, 1)), 4, 0.0, 0),
        'request ids must be distinct; 0 appears more than once'),
    Bad("silent", "reference.execute_plan", "out int32 (the result truncated)",
        lambda: execute(out=np.zeros(Q.shape, np.int32)),
        'out must hold real floating-point values, got dtype int32'),
    Bad("silent", "reference.execute_plan", "out float16 for a float32 cache",
        lambda: execute(out=np.zeros(Q.shape, np.float16)),
        'out is float16 but the cache is float32; they must match'),
    Bad("silent", "reference.execute_plan", "K float32, V float16",
        lambda: execute(v=V.astype(np.float16)),
        'k_cache is float32 but v_cache is float16; K and V must share one dtype'),
    Bad("silent", "reference.reference_decode", "K float32, V float16",
        lambda: reference_decode(Q, K, V.astype(np.float16), OK),
        'k_cache is float32 but v_cache is float16; K and V must share one dtype'),
    Bad("silent", "reference.execute_plan", "a plan for 1 kv head on a batch of 2 (head 1 unwritten)",
        lambda: execute(plan=make_plan(make_batch(AttentionSpec(2, 1, 64, 4, "float32"), [5, 9]), "split",
                                       num_splits=2)), 'the plan was made for a different batch'),
    Bad("silent", "reference.relative_error", "out [2, 3] against ref [3] (broadcast)",
        lambda: relative_error(np.ones((2, 3)), np.ones(3)),
        'out has shape (2, 3) but ref has (3,); they must match'),
    Bad("silent", "reference.relative_error", "complex out (imaginary part dropped)",
        lambda: relative_error(np.ones(3) * 1j, np.ones(3)),
        'out must hold real numbers, got dtype complex128'),
    Bad("silent", "numpy backend run", "out None (the result thrown away)",
        lambda: numpy_run(out=None), 'numpy: run() writes into out, a [B, Hq, D] array; got None'),
    Bad("silent", "traces.active_steps", "max_active 0 (no steps)",
        lambda: active_steps(GOOD_TRACE.requests, 0, None), 'max_active must be >= 1, got 0'),
    Bad("silent", "traces.TorchCompatibleRNG", "seed 1.5 (read as 1)",
        lambda: TorchCompatibleRNG(1.5), 'generator seed 1.5 is not an integer in [0, 2**32)'),
    Bad("silent", "traces.read_trace", "a step with 2 ids and 1 length",
        lambda: read_trace(trace_json(lambda d: d["steps"][0].__setitem__(2, [7]))),
        't.json: malformed persistentkv trace file (step 0 needs one length per request id and at least one '
        'row, got 2 ids and 1 lengths)'),
    Bad("silent", "plan.make_plan", "workqueue target_items 2.7 (read as 2)",
        lambda: make_plan(OK, "workqueue", target_items=2.7), 'target_items must be an integer >= 1, got 2.7'),
    Bad("silent", "plan.make_plan", "padded_buckets bucket_tokens 2.5",
        lambda: make_plan(OK, "padded_buckets", num_splits=2, bucket_tokens=2.5),
        'bucket_tokens must be an integer >= 1 (or None for exact lengths), got 2.5'),
    # ---- accepted where it should be refused ----------------------------------------------------
    Bad("accepted", "cache.Batch", "num_pages 5.5",
        lambda: batch(num_pages=5.5), 'num_pages must be an integer in [1, 2147483648], got 5.5'),
    Bad("accepted", "cache.make_batch", "seed -1",
        lambda: make_batch(SPEC, [5], seed=-1), 'seed=-1 is out of range [0, 4294965269]'),
    Bad("accepted", "cache.make_batch", "seed 1.5",
        lambda: make_batch(SPEC, [5], seed=1.5), 'seed must be an integer, got 1.5'),
    Bad("accepted", "cache.random_cache", "seed -1",
        lambda: random_cache(SPEC, 3, -1), 'seed must be a non-negative integer, got -1'),
    Bad("accepted", "cache.allocate", "page_size 2.5",
        lambda: allocate((Request(0, 0, 5, 1),), 2.5, 0.0, 0), 'page_size must be an integer >= 1, got 2.5'),
    Bad("accepted", "reference.reference_decode", "scale NaN",
        lambda: reference_decode(Q, K, V, OK, scale=float("nan")), 'scale must be a finite number, got nan'),
    Bad("accepted", "reference.execute_plan", "q float16 on a float32 cache",
        lambda: execute(q=Q.astype(np.float16)), 'q is float16 but the cache is float32; they must match'),
    Bad("accepted", "numpy backend run", "cache of three arrays",
        lambda: numpy_run(cache=(K, V, V), out=np.zeros_like(Q)),
        'numpy: cache must be a (K, V) pair, got tuple'),
    Bad("accepted", "traces.from_file", "prompt_len 1_000 (int() reads 1000)",
        lambda: from_file(csv("0,0,1_000,4\n"), 2),
        "t.csv:2: column prompt_len must be an integer, got '1_000'"),
    Bad("accepted", "traces.from_file", "prompt_len in Arabic-Indic digits",
        lambda: from_file(csv("0,0,\u0661\u0662,4\n"), 2),
        "t.csv:2: column prompt_len must be an integer, got '١٢'"),
    Bad("accepted", "traces.from_file", "prompt_len 2**31",
        lambda: from_file(csv(f"0,0,{2**31},4\n"), 2),
        't.csv:2: column prompt_len must be at most 2147483647, got 2147483648'),
    Bad("accepted", "traces.from_file", f"prompt_len + decode_steps past {MAX_SEQ_LEN} tokens",
        lambda: from_file(csv(f"0,0,{MAX_SEQ_LEN},200\n"), 2, num_steps=1),
        't.csv:2: request 0: prompt_len + decode_steps = 2147483720 tokens exceeds the longest row the engine '
        'addresses (2147483520 tokens)'),
    Bad("accepted", "traces.read_trace", "lengths 5.5",
        lambda: read_trace(trace_json(lambda d: d["steps"][0].__setitem__(2, [5.5, 6.5]))),
        't.json: malformed persistentkv trace file (step 0 lengths must be integers, got float64 values such '
        'as 5.5)'),
    Bad("accepted", "traces.read_trace", "a length of 2**40",
        lambda: read_trace(trace_json(lambda d: d["steps"][0].__setitem__(2, [2**40, 5]))),
        't.json: malformed persistentkv trace file (step 0 lengths[0] = 1099511627776 is out of range [1, '
        '2147483520])'),
    Bad("accepted", "traces.read_trace", "a step naming request 99, not in the file",
        lambda: read_trace(trace_json(lambda d: d["steps"][0].__setitem__(1, [0, 99]))),
        't.json: malformed persistentkv trace file (step 0 names request 99, which the file does not list)'),
    Bad("accepted", "traces.read_trace", "max_active -1",
        lambda: read_trace(trace_json(lambda d: d.__setitem__("max_active", -1))),
        't.json: malformed persistentkv trace file (max_active must be >= 1, got -1)'),
    Bad("accepted", "configuration.validate_config", "measure.fragmented.hole_fraction .nan",
        lambda: config_with(lambda c: c["measure"]["fragmented"].update(hole_fraction=float("nan"))),
        'config: measure.fragmented.hole_fraction: nan is not a finite number'),
    Bad("accepted", "configuration.validate_config", "measure.long_context.lengths [2**31]",
        lambda: config_with(lambda c: c["measure"]["long_context"].update(lengths=[2**31])),
        'config: measure.long_context.lengths[0]: 2147483648 exceeds the longest row the engine addresses '
        '(2147483520 tokens)'),
    Bad("accepted", "configuration.validate_config", "measure.bench_shapes.kv_mib [0.001] (a run that measures nothing)",
        lambda: config_with(lambda c: c["measure"]["bench_shapes"].update(kv_mib=[0.001])),
        'config: measure.bench_shapes: no cell of the grid fits: each of its 36 would read rows under one page or '
        'over max_tokens_per_row=1048576 (the first: Hkv=1 G=4 B=1 at 0.001 MiB)'),
    Bad("accepted", "configuration.validate_config", "traces[0].num_requests 10**12",
        lambda: config_with(lambda c: c["traces"][0].update(num_requests=10**12)),
        'config: traces[0].num_requests: 1000000000000 exceeds the maximum of 65536'),
    Bad("accepted", "torch-sdpa unavailable", "device 'tpu' (no reason given)",
        lambda: reasons_of(sdpa("tpu")),
        "torch-sdpa: device 'tpu' is not a torch device name ('cpu', 'cuda', 'cuda:N', ...)"),
    Bad("accepted", "persistentkv claims", "--results on a mistyped folder (exit 0, 11 'not measured')",
        lambda: ["claims", "--results", "results/nvidia-h20", "--out", "c.json"],
        'error: results folder results/nvidia-h20 does not exist (or is not a folder); give the results/<hw> '
        'folder a run wrote', cli=True),
    Bad("accepted", "persistentkv figures", "--results on a missing folder",
        lambda: ["figures", "--results", "results/nvidia-h20", "--out-dir", "figs"],
        'error: results folder results/nvidia-h20 does not exist (or is not a folder); give the results/<hw> '
        'folder a run wrote', cli=True),
    Bad("accepted", "persistentkv report", "--counters on a missing folder",
        lambda: ["report", "--results", ".", "--counters", "nowhere", "--claims", "c.json",
                 "--figures-dir", "figs", "--out", "r.html"],
        'error: counters folder nowhere does not exist (or is not a folder)', cli=True),
    # ---- hangs ----------------------------------------------------------------------------------
    Bad("hang", "traces.from_file", "decode_steps 2000000000, no num_steps",
        lambda: from_file(csv("0,0,16,2000000000\n"), 2),
        "the trace's 2000000000 active steps would hold 2000000000 row lengths, more than the 1048576 a trace "
        'may hold; keep its first steps with num_steps (--num-steps for a file, num_steps in its config entry)'),
    Bad("hang", "persistentkv traces", "--file with decode_steps 2000000000",
        lambda: ["traces", "--file", csv("0,0,16,2000000000\n"), "--max-active", "2", "--out", "t.json"],
        "error: the trace's 2000000000 active steps would hold 2000000000 row lengths, more than the 1048576 a "
        "trace may hold; keep its first steps with num_steps (--num-steps for a file, num_steps in its config "
        "entry)", cli=True),
    Bad("hang", "traces.generate", "num_requests 10**9, num_steps 1",
        lambda: generate("uniform", 1, 10**9, 4, 1), 'num_requests=1000000000 exceeds the maximum of 65536'),
    Bad("hang", "cache.make_batch", "one row of 2**28 tokens (a shuffle of 2**26 pages)",
        lambda: make_batch(SPEC, [2**28]),
        'the requests need a universe of 67108864 pages (67108864 reserved, hole fraction 0.0), more than the '
        '33554432 the allocator shuffles; use shorter rows or larger pages'),
    # ---- raw exceptions -------------------------------------------------------------------------
    Bad("raw", "plan.make_plan", "workqueue min_chunk_tiles '2'",
        lambda: make_plan(OK, "workqueue", target_items=64, min_chunk_tiles="2"),
        "min_chunk_tiles must be an integer >= 1, got '2'"),
    Bad("raw", "plan.make_plan", "split with an option it does not take (target_items)",
        lambda: make_plan(OK, "split", num_splits=2, target_items=64),
        'route split takes num_splits, fused_merge; not target_items'),
    Bad("raw", "plan.make_plan", "batch None",
        lambda: make_plan(None, "split", num_splits=2), 'the planner takes a cache.Batch, got NoneType'),
    Bad("raw", "spec.AttentionSpec", "dtype ['float16'] (unhashable)",
        lambda: AttentionSpec(dtype=["float16"]),
        "dtype=['float16'] is not one of ['bfloat16', 'float16', 'float32', 'float64']"),
    Bad("raw", "spec.AttentionSpec.from_dict", "None",
        lambda: AttentionSpec.from_dict(None),
        'an AttentionSpec is read from a mapping of its fields, got None'),
    Bad("raw", "spec.AttentionSpec.from_dict", "{1: 2} (a key that is not a string)",
        lambda: AttentionSpec.from_dict({1: 2}), 'unknown AttentionSpec field(s): 1'),
    Bad("raw", "cache.Batch", "seq_lens [[5], [9, 1]] (ragged)",
        lambda: batch(seq_lens=[[5], [9, 1]]),
        'seq_lens must be a 1-D array of integers, got ragged [[5], [9, 1]]'),
    Bad("raw", "cache.Batch", "spec None",
        lambda: batch(spec=None), 'spec must be an AttentionSpec, got NoneType'),
    Bad("raw", "cache.Batch", "num_pages '9'",
        lambda: batch(num_pages="9"), "num_pages must be an integer in [1, 2147483648], got '9'"),
    Bad("raw", "cache.make_batch", "lengths [[1, 2], [3]] (ragged)",
        lambda: make_batch(SPEC, [[1, 2], [3]]),
        'lengths must be a 1-D array of integers, got ragged [[1, 2], [3]]'),
    Bad("raw", "cache.make_batch", "lengths [2**31] (randperm's error from deep inside)",
        lambda: make_batch(SPEC, [2**31]), 'lengths[0] = 2147483648 is out of range [1, 2147483520]'),
    Bad("raw", "cache.make_batch", "seed '1'",
        lambda: make_batch(SPEC, [5], seed="1"), "seed must be an integer, got '1'"),
    Bad("raw", "cache.allocate", "page_size 0 (ZeroDivisionError)",
        lambda: allocate((Request(0, 0, 5, 1),), 0, 0.0, 0), 'page_size must be an integer >= 1, got 0'),
    Bad("raw", "cache.allocate", "requests None",
        lambda: allocate(None, 4, 0.0, 0), 'requests must be a sequence of Request, got NoneType'),
    Bad("raw", "cache.batch_for_step", "a request id the allocation lacks (KeyError)",
        lambda: batch_for_step(SPEC, ALLOCATION, Step(0, (7,), (5,))),
        'request 7 has no pages in this allocation'),
    Bad("raw", "cache.batch_for_step", "length '5'",
        lambda: batch_for_step(SPEC, ALLOCATION, Step(0, (0,), ("5",))),
        "lengths must be integers, got <U1 values such as '5'"),
    Bad("raw", "cache.random_cache", "num_pages 2.5",
        lambda: random_cache(SPEC, 2.5, 0), 'num_pages must be an integer in [1, 2147483648], got 2.5'),
    Bad("raw", "cache.random_cache", "num_pages -1",
        lambda: random_cache(SPEC, -1, 0), 'num_pages must be an integer in [1, 2147483648], got -1'),
    Bad("raw", "cache.random_cache", "2**30 pages of the published shape (MemoryError)",
        lambda: random_cache(AttentionSpec(), 2**30, 0),
        '2 x [1073741824, 16, 8, 128] random float16 values need ~3.28e+05 GiB of host memory, more than this '
        'machine can allocate'),
    Bad("raw", "cache.random_queries", "seed 1.5",
        lambda: random_queries(SPEC, 2, 1.5), 'seed must be a non-negative integer, got 1.5'),
    Bad("raw", "reference.reference_decode", "q as a list",
        lambda: reference_decode(Q.tolist(), K, V, OK), 'q must be a NumPy array, got list'),
    Bad("raw", "reference.reference_decode", "batch None",
        lambda: reference_decode(Q, K, V, None), 'batch must be a Batch, got NoneType'),
    Bad("raw", "reference.reference_decode", "scale 'x'",
        lambda: reference_decode(Q, K, V, OK, scale="x"), "scale must be a finite number, got 'x'"),
    Bad("raw", "reference.execute_plan", "out of shape [2, 4, 32]",
        lambda: execute(out=np.zeros((2, 4, 32), np.float32)),
        'out has shape (2, 4, 32), expected (2, 4, 64)'),
    Bad("raw", "reference.execute_plan", "a read-only out",
        lambda: execute(out=np.broadcast_to(np.zeros(1, np.float32), Q.shape)), 'out is read-only'),
    Bad("raw", "reference.execute_plan", "plan None",
        lambda: execute(plan=None), 'plan must be a Plan (plan.make_plan), got NoneType'),
    Bad("raw", "reference.relative_error", "shapes [3] and [4]",
        lambda: relative_error(np.ones(3), np.ones(4)),
        'out has shape (3,) but ref has (4,); they must match'),
    Bad("raw", "reference.relative_error", "ragged [[1], [1, 2]]",
        lambda: relative_error([[1], [1, 2]], [[1], [1, 2]]),
        'out must be an array of numbers, got a ragged list'),
    Bad("raw", "numpy backend plan", "batch None",
        lambda: NumpyBackend().plan(None), 'numpy: batch must be a Batch, got NoneType'),
    Bad("raw", "numpy backend run", "the Plan instead of what plan() returned",
        lambda: numpy_run(plan=PLAN, out=np.zeros_like(Q)),
        'numpy: plan must be what NumpyBackend.plan returned, got Plan'),
    Bad("raw", "torch-sdpa run", "NumPy arrays instead of tensors",
        lambda: sdpa_run(q=Q), 'torch-sdpa: q must be a torch tensor, got ndarray'),
    Bad("raw", "torch-sdpa run", "K and V of one page (IndexError)",
        lambda: sdpa_run(pages=1), "torch-sdpa: K has 1 pages, the plan's batch addresses 5"),
    Bad("raw", "torch-sdpa run", "plan None",
        lambda: sdpa().run(None, None, None, None),
        'torch-sdpa: plan must be what plan() returned, got NoneType'),
    Bad("raw", "torch-sdpa plan", "device 'tpu' (RuntimeError)",
        lambda: sdpa("tpu").plan(OK),
        "torch-sdpa: device 'tpu' is not a torch device name ('cpu', 'cuda', 'cuda:N', ...)"),
    Bad("raw", "traces.from_file", "path None",
        lambda: from_file(None, 2), 'trace file must be a path, got None'),
    Bad("raw", "traces.from_file", "prompt_len of 23 digits (OverflowError)",
        lambda: from_file(csv("0,0,99999999999999999999999,4\n"), 2),
        't.csv:2: column prompt_len must be at most 2147483647, got 99999999999999999999...'),
    Bad("raw", "traces.build", "entry None",
        lambda: build(None, 1), 'a trace entry is a mapping of its keys, got None'),
    Bad("raw", "traces.build", "an entry without max_active (KeyError)",
        lambda: build({"name": "x", "kind": "uniform", "num_requests": 3}, 1),
        "trace entry 'x' lacks max_active"),
    Bad("raw", "traces.read_trace", "a step with no rows (max() of nothing)",
        lambda: read_trace(trace_json(lambda d: d["steps"].__setitem__(0, [0, [], []]))),
        't.json: malformed persistentkv trace file (step 0 needs one length per request id and at least one '
        'row, got 0 ids and 0 lengths)'),
    Bad("raw", "traces.read_trace", "JSON nested 100000 deep (RecursionError)",
        lambda: read_trace(file_with("t.json", b"[" * 100_000 + b"]" * 100_000)),
        't.json: not a persistentkv trace file (JSON nested too deeply)'),
    Bad("raw", "traces.Trace.from_json", "None",
        lambda: Trace.from_json(None), 'a trace is read from JSON text, got NoneType'),
    Bad("raw", "traces.Step", "no rows, then max_len",
        lambda: Step(0, (), ()).max_len,
        'step 0 needs one length per request id and at least one row, got 0 ids and 0 lengths'),
    Bad("raw", "traces.TorchCompatibleRNG.randperm", "n 2.5",
        lambda: TorchCompatibleRNG(1).randperm(2.5), 'randperm size 2.5 out of range'),
    Bad("raw", "configuration.load_config", "path None",
        lambda: configuration.load_config(None), 'config file must be a path, got None'),
    Bad("raw", "persistentkv traces", "--out under a file (/dev/null/t.json): a traceback",
        lambda: ["traces", "--file", csv("0,0,16,4\n"), "--max-active", "2", "--out", "/dev/null/t.json"],
        "error: /dev/null: File exists (check the path and its permissions)", cli=True),
    Bad("raw", "configuration.load_config", "a file that is not text (UnicodeDecodeError)",
        lambda: configuration.load_config(file_with("c.yaml", b"spec: \xff\xfe\xfa\n")),
        'config: c.yaml is not a text file (invalid start byte at byte 6)'),
]


def message_of(case: Bad, capsys) -> str:
    """The one line ``case`` gives now (its call must give exactly one: a PKVError, or exit 2)."""
    if case.cli:
        code = cli.main([str(a) for a in case.call()])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), (code, err)
        return err.strip()
    with pytest.raises(PKVError) as info:
        case.call()
    text = str(info.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_gives_its_one_line_message(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)        # files a row writes (t.csv, t.json) land here, named relatively
    with within(ROW_SECONDS):
        assert message_of(case, capsys) == case.message


def test_every_group_has_rows_and_ids_are_unique():
    assert {case.kind for case in CASES} == set(KINDS)
    assert len({case.id for case in CASES}) == len(CASES)


# ---- the docs page -----------------------------------------------------------------------------

def code(text: str) -> str:
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def prose(text: str) -> str:
    """Markdown-safe: 2**31 is not bold, a | does not end the cell."""
    return text.replace("*", "\\*").replace("|", "\\|").replace("<", "&lt;")


def page_cases() -> list[Bad]:
    """The page's rows: CASES, then the FP8 cache's (tests/test_fp8.py runs those, beside the FP8
    tests; imported here, not at the top, since test_fp8 imports Bad from this module)."""
    from test_fp8 import FP8_BAD_INPUT

    return CASES + FP8_BAD_INPUT


def render_page() -> str:
    cases = page_cases()
    lines = [
        "# Bad input: what the public API and the CLI say",
        "",
        "Generated from the parameter table of `tests/test_bad_input.py`, which runs every row (and",
        "checks that this page matches it): `python tests/test_bad_input.py > docs/BAD_INPUT.md`.",
        "Each row is an input that once gave a wrong answer, was accepted, hung or raised a raw",
        "exception from deep inside, and the one-line `PKVError` it gives now (the CLI prints it as",
        "`error: ...` and exits with status 2).",
        "",
        "Limits the checks enforce, once, where the value enters:",
        "",
        f"- a row is at most `MAX_SEQ_LEN` = {MAX_SEQ_LEN} tokens (`spec.py`: the kernel's int32",
        "  token indices reach a row's length plus one 128-token tile);",
        f"- page ids, block-table offsets and request fields are int32: at most {MAX_PAGES} pages;",
        "  integer arrays must have an integer dtype (a float page id is refused, never truncated);",
        f"- the allocator shuffles at most {MAX_ALLOCATION_PAGES} pages (`cache.MAX_ALLOCATION_PAGES`);",
        f"- a trace holds at most {MAX_TRACE_REQUESTS} requests and {MAX_TRACE_ROWS} row lengths over its",
        "  steps (`traces.MAX_TRACE_ROWS`), counted before any step is made; `num_steps` (`--num-steps`)",
        "  keeps the first steps of a longer one.",
    ]
    for kind, title in KINDS.items():
        lines += ["", f"## {title}", "", "| function | bad value | message now given |", "|---|---|---|"]
        lines += [f"| {code(c.function)} | {prose(c.value)} | {code(c.message)} |" for c in cases if c.kind == kind]
    return "\n".join(lines) + "\n"


def test_docs_page_is_the_table():
    assert PAGE.read_text() == render_page(), "regenerate: python tests/test_bad_input.py > docs/BAD_INPUT.md"


if __name__ == "__main__":
    sys.stdout.write(render_page())
