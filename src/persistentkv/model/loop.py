"""The decode loop: one paged cache per layer, append, attention through any backend, sampling.

    kv = PagedKV(shape, num_pages, page_size=16, dtype=torch.float16, device="cuda")
    loop = DecodeLoop(Model(shape, weights), kv, "pkv-workqueue")
    loop.admit(request_id, cached=4095, token=7, reserve=4096 + 64)  # or loop.prefill(rid, prompt, reserve)
    logits = loop.step()          # eager: plan, then every layer; tokens and positions advance
    loop.capture(); loop.replay()  # the same step as one CUDA graph

A step as a server runs it. Each row's next token is embedded, and in every layer its K and V are
written into the row's last page at its position (``slot = table[row, pos // P] * P + pos % P``,
index math on the device), then attention runs over ``pos + 1`` tokens. The plan is made once per
step and every layer reuses it. The cache is one tensor ``[L, 2, pages, P, Hkv, D]``: layer l's K
and V are contiguous ``[pages, P, Hkv, D]`` views (NHD), read in place by every backend.

How a captured step keeps its plan right while the lengths grow is the backend's declared
``capabilities.graph`` (persistentkv.backends.base; :func:`follow_mode`); the loop reads nothing
else of a backend but its name, ``unavailable``, ``plan``, ``run`` and ``capabilities.host_arrays``:

* ``device``: the plan is made once for the rows' reserved pages, and the captured step calls
  ``plan.update_lengths(lengths)`` with each row's real length, so the whole step, append and
  sampling included, replays with no host work and no synchronisation between replays
  (pkv-workqueue re-plans on the GPU; vllm-fa3 and trtllm-xqa copy the lengths; torch-sdpa
  rewrites its key mask).
* ``host``: ``backend.plan`` runs on the host before a replay whose lengths changed and rewrites
  the captured buffers in place: FlashInfer's CUDA-graph wrappers, as a FlashInfer-based server
  does (the first plan, for the reservation, sizes the wrapper's index buffer).
* ``replan``: neither; the host plans every step and a captured step is re-captured whenever the
  lengths change (pkv-buckets, pkv-split, adaptive: host-planned items). A backend whose graph is
  ``none`` (numpy) steps the same way, eagerly only: :meth:`DecodeLoop.capture` refuses it.

Rows arrive and leave (:meth:`DecodeLoop.follow`, driven by a persistentkv.traces step): pages
come from a seeded free list and return to it, and a change of the batch's rows re-plans and
re-captures (``recaptures`` counts it).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from ..cache import Batch
from ..errors import require
from .llama import Kernels, Sampling, Weights, sample
from ..fp8 import store_e4m3
from .pages import PagedKV
from .shape import ModelShape

FOLLOW_MODES = ("device", "host", "replan")
#: The graphs DecodeLoop captures of its own: ``step``, the whole step; ``rest``, the step without
#: its attention (each layer's append kept, the plan's device refresh left out). Other bodies over
#: the loop's rows join them through :meth:`DecodeLoop.add_graph` (measure-e2e's attention-alone
#: graphs: persistentkv.measure.steps).
GRAPHS = ("step", "rest")


class Model:
    """A decoder's weights and kernels; :meth:`forward` runs T tokens through every layer."""

    def __init__(self, shape: ModelShape, weights: Weights, kernels: str = "torch", max_position: int = 0):
        self.shape, self.weights = shape, weights
        self.dtype, self.device = weights.embed.dtype, weights.embed.device
        self.kernels = Kernels(kernels, shape, self.device, max_position)

    def forward(self, tokens, positions, attend: Callable):
        """Run T tokens through every layer.

        Parameters
        ----------
        tokens : torch.Tensor
            int64 [T], the input tokens.
        positions : torch.Tensor
            int64 [T], each token's position (rotary angle).
        attend : callable
            ``attend(l, q, k, v)`` gets layer l's rotated q [T, Hq, D] and rotated k and v
            [T, Hkv, D] (model dtype), stores k and v where it keeps them, and returns the
            attention output [T, Hq, D].

        Returns
        -------
        torch.Tensor
            logits [T, V] in the model's dtype.
        """
        s, w, K = self.shape, self.weights, self.kernels
        T, D = tokens.shape[0], s.head_dim
        a, kv = s.num_heads * D, s.num_kv_heads * D
        x = w.embed[tokens]  # the residual stream (a copy: the adds below are in place)
        h = K.rmsnorm(x, w.attn_norm[0])
        for l in range(s.num_layers):
            qkv = K.linear(h, w.qkv[l])
            q, k = K.rotary(qkv, positions)
            o = attend(l, q, k, qkv[:, a + kv:].view(T, s.num_kv_heads, D))
            h = K.add_rmsnorm(K.linear(o.reshape(T, a), w.o[l]), x, w.mlp_norm[l])
            down = K.linear(K.gate_up_silu(h, w.gate_up[l]), w.down[l])
            h = K.add_rmsnorm(down, x, w.attn_norm[l + 1] if l + 1 < s.num_layers else w.norm)
        return K.linear(h, w.lm_head)


def follow_mode(backend) -> str:
    """How the loop follows growing lengths with ``backend`` (:data:`FOLLOW_MODES`, module
    docstring): its ``capabilities.graph``, where ``none`` (never captured) steps as ``replan``."""
    graph = backend.capabilities.graph
    return "replan" if graph == "none" else graph


class DecodeLoop:
    """One backend's decode loop over a shared model and cache; owns the rows, positions, plan.

    State on the device (rebuilt when rows arrive or leave): ``tokens`` int64 [B] (each row's
    next input token), ``positions`` int64 [B] (where it goes: the row's cached token count),
    ``lengths`` int32 [B] (= positions + 1, what attention reads), ``logits`` float32 [B, V] of
    the last step. The host mirrors the positions (a step adds one), so it plans without reading
    the device.
    """

    def __init__(self, model: Model, kv: PagedKV, backend, sampling: Sampling = Sampling(),
                 log: Callable[[str], None] | None = None):
        from ..backends import registry

        self.model, self.kv, self.sampling = model, kv, sampling
        self.backend = registry.create(backend) if isinstance(backend, str) else backend
        self.spec = model.shape.attention_spec(kv.page_size, kv.dtype_name, kv.kv_dtype)
        reasons = self.backend.unavailable(self.spec)
        require(not reasons, f"backend {self.backend.name} cannot run {self.spec}: {'; '.join(reasons)}")
        #: run() takes host NumPy arrays (read once: _run is called per layer)
        self.host_arrays = self.backend.capabilities.host_arrays
        require(kv.dtype == model.dtype and kv.device == model.device,
                f"the cache ({kv.dtype}, {kv.device}) and the model ({model.dtype}, {model.device}) must match")
        self.log = log or (lambda message: None)
        self.rows: list[int] = []
        self.positions_host = np.zeros(0, np.int64)
        self._new_tokens: dict[int, int] = {}
        self._dirty = True
        self.plan = None
        self.mode = None
        self._planned = None     # host lengths the current plan was made for (host and replan modes)
        self._graphs: dict[str, Any] = {}
        # add_graph's bodies; the loop's own (GRAPHS) are bound when captured, so a loop is in no
        # reference cycle of its own and a dropped one frees its graphs, plans and buffers at once
        self._bodies: dict[str, Callable[[], None]] = {}
        self.recaptures = 0
        self.replans = 0
        self.tokens = self.positions = self.lengths = self.keys = self.table = None
        self._token_rows: list[int] = []
        self.out = self.logits = None

    # -- rows ---------------------------------------------------------------------------------
    def admit(self, rid: int, cached: int, token: int, reserve: int) -> None:
        """Add a row to the batch (device state is rebuilt at the next step).

        Parameters
        ----------
        rid : int
            Request id (the sampler's key; pages are held per id).
        cached : int
            Tokens of K/V already in its pages (a prefill's, or the speed run's random values);
            its next token goes to position ``cached``.
        token : int
            Its next input token.
        reserve : int
            Tokens its pages must hold (its room to grow), > ``cached``.
        """
        require(cached >= 0 and reserve > cached, f"row {rid}: reserve ({reserve}) must exceed cached ({cached})")
        self.kv.pool.reserve(rid, reserve)
        self.rows.append(int(rid))
        self.positions_host = np.append(self.positions_host, np.int64(cached))
        self._new_tokens[int(rid)] = int(token)
        self._dirty = True

    def retire(self, rid: int) -> None:
        index = self.rows.index(rid)
        self.kv.pool.release(rid)
        del self.rows[index]
        self.positions_host = np.delete(self.positions_host, index)
        self._dirty = True

    def prefill(self, rid: int, prompt, reserve: int):
        """Prefill a row: plain causal attention over the prompt, its K/V written into the row's
        pages; the row joins with its first sampled token as the next input.

        Parameters
        ----------
        rid : int
            Request id.
        prompt : array-like
            int [n], n >= 1 tokens.
        reserve : int
            Tokens its pages must hold, > n.

        Returns
        -------
        torch.Tensor
            float32 [V], the logits at the prompt's last position.
        """
        import torch
        import torch.nn.functional as F

        prompt = torch.as_tensor(np.asarray(prompt, np.int64), device=self.kv.device)
        n, P, s = int(prompt.numel()), self.kv.page_size, self.model.shape
        require(n >= 1, f"row {rid}: an empty prompt")
        self.admit(rid, n, 0, reserve)
        pages = torch.as_tensor(self.kv.pool.pages(rid).astype(np.int64), device=self.kv.device)
        positions = torch.arange(n, device=self.kv.device)
        slots = pages[positions // P] * P + positions % P

        def attend(l, q, k, v):
            k_flat, v_flat = self.kv.flat(l)
            k_scale, v_scale = self.kv.layer_scales(l)
            if k_scale is None:
                k_flat.index_copy_(0, slots, k)
                v_flat.index_copy_(0, slots, v)
            else:  # an FP8 cache stores the codes; the prompt's own attention reads k and v as computed
                store_e4m3(k_flat, slots, k, k_scale)
                store_e4m3(v_flat, slots, v, v_scale)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               is_causal=True, enable_gqa=True, scale=s.head_dim ** -0.5)
            return o.transpose(0, 1)

        logits = self.model.forward(prompt, positions, attend)[-1:].float()
        first = sample(logits, self.sampling.top_k, self.sampling.seed,
                       torch.tensor([rid], device=self.kv.device), positions[-1:], self.sampling.temperature)
        self._new_tokens[int(rid)] = int(first.item())
        return logits[0]

    def follow(self, request_ids, lengths, reserve: dict[int, int], first_token: Callable[[int], int]) -> bool:
        """Match the rows to one trace step (persistentkv.traces.Step).

        Rows not in ``request_ids`` leave; new ones arrive with ``length - 1`` tokens cached (so
        attention reads ``length``), pages for ``reserve[rid]`` tokens and ``first_token(rid)`` as
        their input; the rows take the step's order.

        Parameters
        ----------
        request_ids : sequence of int
            The step's rows, [B].
        lengths : sequence of int
            Each row's attention length at this step, [B].
        reserve : dict
            Request id -> tokens to reserve on arrival.
        first_token : callable
            Request id -> its first input token.

        Returns
        -------
        bool
            Whether the batch changed (the next step re-plans and re-captures).
        """
        ids = [int(r) for r in request_ids]
        gone = [r for r in self.rows if r not in ids]
        new = [(r, int(n)) for r, n in zip(ids, lengths) if r not in self.rows]
        for rid in gone:
            self.retire(rid)
        for rid, n in new:
            self.admit(rid, n - 1, first_token(rid), reserve[rid])
        if self.rows != ids:
            order = [self.rows.index(r) for r in ids]
            self.rows, self.positions_host = ids, self.positions_host[order]
            self._dirty = True
        want = np.asarray(lengths, np.int64) - 1
        if not np.array_equal(want, self.positions_host):
            self.set_positions(want)
        changed = bool(gone or new) or self._dirty
        if changed:
            self.log(f"rows +{[r for r, _ in new]} -{gone}: re-plan and re-capture")
        return changed

    # -- device state -------------------------------------------------------------------------
    def _upload(self, values, dtype):
        import torch

        host = torch.as_tensor(np.asarray(values), dtype=dtype)
        if self.kv.device.type != "cuda":
            return host.clone()
        return host.pin_memory().to(self.kv.device, non_blocking=True)

    def _rebuild(self) -> None:
        """Device state for the current rows (continuing rows keep their device tokens)."""
        import torch

        require(self.rows, "the loop has no rows; admit() some first")
        dev, s = self.kv.device, self.model.shape
        B = len(self.rows)
        old = {rid: i for i, rid in enumerate(self._token_rows)} if self.tokens is not None else {}
        tokens = self._upload([self._new_tokens.get(r, 0) for r in self.rows], torch.int64)
        kept = [(i, old[r]) for i, r in enumerate(self.rows) if r in old and r not in self._new_tokens]
        if kept:
            to, frm = (self._upload(x, torch.int64) for x in zip(*kept))
            tokens.index_copy_(0, to, self.tokens.index_select(0, frm))
        self._new_tokens.clear()
        self._token_rows = list(self.rows)
        pages = [self.kv.pool.pages(r) for r in self.rows]
        width = max(p.size for p in pages)
        table = np.zeros((B, width), np.int64)
        for i, p in enumerate(pages):
            table[i, :p.size] = p
        self.tokens, self.table = tokens, self._upload(table, torch.int64)
        self.positions = self._upload(self.positions_host, torch.int64)
        self.lengths = torch.empty(B, dtype=torch.int32, device=dev)
        self.keys = self._upload(self.rows, torch.int64)
        self.out = torch.empty((B, s.num_heads, s.head_dim), dtype=self.model.dtype, device=dev)
        self.logits = torch.empty((B, s.vocab_size), dtype=torch.float32, device=dev)
        self.model.kernels.reserve_positions(int(table.shape[1]) * self.kv.page_size)
        self._replan(capacity=True)
        if self._graphs:
            self.recaptures += 1
        self._graphs = {}
        self._dirty = False

    def batch(self, capacity: bool = False) -> Batch:
        """The step's Batch at the rows' real lengths, or (``capacity``) at their reserved pages."""
        P = self.kv.page_size
        pages = [self.kv.pool.pages(r) for r in self.rows]
        lengths = np.array([p.size * P for p in pages]) if capacity else self.positions_host + 1
        counts = -(-lengths // P)
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        indices = np.concatenate([p[:c] for p, c in zip(pages, counts)]).astype(np.int32)
        return Batch(self.spec, lengths.astype(np.int32), indptr, indices, self.kv.num_pages)

    def _replan(self, capacity: bool = False) -> None:
        """Plan the step: a device-mode backend for the reservation (once per set of rows), the
        others for the real lengths."""
        if capacity:  # every mode: a host-mode backend's first plan sizes its buffers for the reservation
            plan = self.backend.plan(self.batch(capacity=True))
            self.mode = follow_mode(self.backend)
            if self.mode == "device":
                self.plan, self._planned = plan, None
                self.replans += 1
                return
        plan = self.backend.plan(self.batch())
        if self.mode == "replan" and self._graphs:
            # the captured graphs read the old plan's buffers, which go with it: both re-capture
            # at their next replay (one attention graph kept past its plan read freed memory)
            self._graphs = {}
            self.recaptures += 1
        self.plan = plan
        self._planned = self.positions_host.copy()
        self.replans += 1

    def _prepare(self) -> None:
        if self._dirty:
            self._rebuild()
        reserved = np.array([self.kv.pool.pages(r).size for r in self.rows]) * self.kv.page_size
        full = np.flatnonzero(self.positions_host >= reserved)
        require(full.size == 0, f"row {self.rows[full[0]] if full.size else 0} has filled the "
                                f"{reserved[full[0]] if full.size else 0} tokens it reserved")
        if self.mode != "device" and not np.array_equal(self._planned, self.positions_host):
            self._replan()

    def set_positions(self, positions) -> None:
        """Every row's position (int [B]; attention then reads positions + 1 tokens)."""
        self.positions_host = np.asarray(positions, np.int64).copy()
        if not self._dirty and self.positions is not None:
            self.positions.copy_(self._upload(self.positions_host, self.positions.dtype))

    def next_tokens(self):
        """The rows' next input tokens, int64 [B] on the device (the loop's buffer)."""
        self._prepare()
        return self.tokens

    def set_tokens(self, tokens) -> None:
        """Overwrite the rows' next input tokens (teacher forcing).

        Parameters
        ----------
        tokens : torch.Tensor
            int64 [B] on the loop's device.
        """
        self._prepare()
        self.tokens.copy_(tokens)

    def mark(self) -> tuple:
        """The device state a later :meth:`rewind` restores (tokens, positions, host positions)."""
        self._prepare()
        return self.tokens.clone(), self.positions.clone(), self.positions_host.copy()

    def rewind(self, marked: tuple) -> None:
        tokens, positions, host = marked
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.positions_host = host.copy()

    # -- the step's pieces (a body over the loop's rows: the step below, measure-e2e's graphs) ---
    def refresh(self, plan: bool = True) -> None:
        """lengths = positions + 1, into the plan when it follows them on the device (``plan``
        False: the lengths only, as the step without attention needs them)."""
        self.lengths.copy_(self.positions + 1)
        if plan and self.mode == "device":
            self.plan.update_lengths(self.lengths)

    def attend(self, layer: int, q) -> None:
        """Layer ``layer``'s attention on ``q`` [B, Hq, D] over its cache with the step's plan, into
        the loop's ``out`` [B, Hq, D]."""
        cache = self.kv.cache_of(layer)
        if self.host_arrays:  # e.g. the NumPy executor: host arrays (the CPU tensors' memory; FP8 codes as uint8)
            import torch

            arrays = tuple((t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).numpy() for t in cache)
            self.backend.run(q.numpy(), arrays, self.plan, self.out.numpy())
        else:
            self.backend.run(q, cache, self.plan, self.out)

    def slots(self):
        """Each row's cache row for its position: the last page's slot (index math on the device)."""
        P, pos = self.kv.page_size, self.positions
        return self.table.gather(1, (pos // P)[:, None]).squeeze(1) * P + pos % P

    def append(self, layer: int, slots, k, v) -> None:
        """Write k, v [B, Hkv, D] into layer ``layer``'s cache rows ``slots`` (:meth:`slots`)."""
        k_flat, v_flat = self.kv.flat(layer)
        self.model.kernels.append(k_flat, v_flat, slots, k, v, *self.kv.layer_scales(layer))

    def _body(self, attention: bool = True) -> None:
        """The step; ``attention`` False: the step without attention (the rest graph), the plan's
        device refresh left out with it (it is the backend's), each layer's append kept."""
        import torch

        self.refresh(plan=attention)
        pos = self.positions
        slots = self.slots()

        def attend(l, q, k, v):
            self.append(l, slots, k, v)
            if attention:
                self.attend(l, q)
            return self.out

        logits = self.model.forward(self.tokens, pos, attend)
        self.logits.copy_(logits)
        s = self.sampling
        self.tokens.copy_(sample(self.logits, s.top_k, s.seed, self.keys, pos, s.temperature))
        torch.add(pos, 1, out=pos)

    def step(self):
        """One eager decode step: tokens and positions advance on the device and the host.

        Returns
        -------
        torch.Tensor
            float32 [B, V], the step's logits (the loop's buffer, overwritten by the next step).
        """
        self._prepare()
        self._body()
        self.positions_host += 1
        return self.logits

    # -- CUDA graphs --------------------------------------------------------------------------
    def add_graph(self, name: str, body: Callable[[], None]) -> None:
        """Capture, replay and drop ``body`` as ``name`` beside the loop's own :data:`GRAPHS`: a
        body over the rows' current state that leaves the positions where they are (replaying it
        does not advance them). Its graph goes with the others when the rows or the plan change,
        and the next :meth:`replay` of it re-captures."""
        require(name not in GRAPHS, f"{name!r} is one of the loop's own graphs")
        self._bodies[name] = body

    def capture(self, what: str = "step") -> None:
        """Capture ``what`` (:data:`GRAPHS`, or a body of :meth:`add_graph`) in a CUDA graph, after
        one eager warm-up whose effects are rewound."""
        from ..measure.device import capture_graph

        names = (*GRAPHS, *self._bodies)
        require(what in names, f"capture what must be one of {', '.join(names)}, got {what!r}")
        require(self.backend.capabilities.graph != "none",
                f"backend {self.backend.name} is not graph-safe (capabilities.graph is 'none'): it runs eagerly only")
        require(self.kv.device.type == "cuda", "CUDA graphs need the loop on a CUDA device")
        body = self._bodies.get(what) or functools.partial(self._body, attention=what == "step")
        marked = self.mark()

        def warmup():  # lazy initialisation (cuBLAS handles, JIT modules) must not happen inside capture
            body()
            self.rewind(marked)

        self._graphs[what] = capture_graph(body, self.kv.device, warmup=warmup)

    def replay(self, what: str = "step") -> None:
        """Replay the captured ``what``; a ``replan``-mode loop re-plans when the lengths changed
        since its plan, which drops its graphs (they read the old plan's buffers) and re-captures
        here, a ``host``-mode one re-plans into the captured buffers."""
        self._prepare()
        if what not in self._graphs:
            self.capture(what)
        self._graphs[what]()
        if what in ("step", "rest"):
            self.positions_host += 1

    def graph_ready(self, what: str = "step") -> bool:
        """Whether ``what`` is captured for the current rows and lengths (a change of rows, or of
        lengths in ``replan`` mode, drops the graphs first)."""
        self._prepare()
        return what in self._graphs

