"""The Llama decoder in plain torch: seeded weights, RMSNorm, rotary embedding, SwiGLU, sampling.

Everything here computes what Hugging Face's ``LlamaForCausalLM`` computes (transformers 5.x,
models/llama/modeling_llama.py), operation for operation, so float32 logits agree to rounding:

* RMSNorm: ``w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``;
* rotary embedding, rotate-half ("NeoX") convention: ``inv_freq = 1 / theta^(arange(0, D, 2) / D)``,
  ``cos, sin`` of ``position * inv_freq`` repeated over both halves and cast to the activations'
  dtype, ``q * cos + rotate_half(q) * sin`` with ``rotate_half(x) = [-x2, x1]``. The interleaved
  (GPT-J) convention gives different numbers from the same weights, silently;
* SwiGLU: ``down(silu(gate(x)) * up(x))``.

Weights are laid out as ``torch.nn.functional.linear`` takes them ([out, in]); the QKV projection
is one fused matrix ``[q | k | v]`` and the MLP's gate and up projections one ``[gate | up]``,
stacked over layers (``qkv[l]`` is layer l's). Values are seeded normals scaled by
``1 / sqrt(fan_in)``, so activations stay O(1) through any depth; timing does not depend on them.

``Kernels`` picks how the norms, the rotary embedding, the activation, the projections and the
K/V append run: ``torch`` (the operations above), ``flashinfer`` (``flashinfer.norm.rmsnorm`` /
``fused_add_rmsnorm``, ``flashinfer.rope.apply_rope_with_cos_sin_cache`` on a float32 table
computed as above, ``flashinfer.activation.silu_and_mul``), the fused kernels a FlashInfer-based
server runs, or ``pkv``: FlashInfer's norms and rotary plus our kernels for the decode step's
one-row case (persistentkv.model.step_ops, kernels/step_ops.cu): a projection of T = 1 row is
our gemv, the MLP's gate|up projection and SiLU-and-mul are one gemv_silu_mul, and a layer's two
K/V appends one append_kv. Under ``torch`` and ``flashinfer`` the projections are ``F.linear``
(cuBLAS) and the append two ``index_copy_``; ``pkv`` falls back to the same for T > 1 (a
prefill) or any input its kernels refuse (step_ops.gemv_unsupported: dtype, K % 8, strides,
alignment).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..env import missing_module
from ..errors import PKVError, require
from . import step_ops
from .shape import ModelShape


def resolve_device(device):
    """``device`` as the torch.device tensors placed there report: "cuda" becomes "cuda:<current>",
    so two devices compare equal when they are the same GPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device

#: Values of Kernels(name); "auto" is :func:`auto_kernels`.
KERNEL_CHOICES = ("auto", "torch", "flashinfer", "pkv")


def auto_kernels(device_type: str, missing=missing_module) -> str:
    """What ``kernels="auto"`` runs: ``pkv`` on CUDA where FlashInfer and CuPy import, else
    ``flashinfer`` on CUDA where it imports, else ``torch``. pkv is the default because it won in
    every cell measured (benchmarks/runs/step_probe_739ebad, part ``steps``: the graph-replayed step
    0.885x flashinfer's at Llama-3-8B B=1 x 4K, 0.889x at the 70B shard's B=1 x 32K, 0.993x at
    B=16 x 32K, where only the append differs). ``missing(name)``: reasons a module does not import."""
    if device_type != "cuda" or missing("flashinfer"):
        return "torch"
    return "flashinfer" if missing("cupy") else "pkv"


@dataclass
class Weights:
    """One model's parameters (H = hidden, A = Hq * D, Q = (Hq + 2 Hkv) * D, I = intermediate,
    L = layers, V = vocabulary), all of one dtype on one device.

    embed:     [V, H]
    attn_norm: [L, H]
    qkv:       [L, Q, H]      rows: q heads, then k heads, then v heads
    o:         [L, H, A]
    mlp_norm:  [L, H]
    gate_up:   [L, 2I, H]     rows: gate, then up
    down:      [L, H, I]
    norm:      [H]
    lm_head:   [V, H]         not tied to ``embed``
    """

    embed: Any
    attn_norm: Any
    qkv: Any
    o: Any
    mlp_norm: Any
    gate_up: Any
    down: Any
    norm: Any
    lm_head: Any

    def to(self, dtype) -> "Weights":
        """A copy in ``dtype`` (the float32 reference loop's weights from the served ones)."""
        return Weights(**{f.name: getattr(self, f.name).to(dtype) for f in fields(self)})


def random_weights(shape: ModelShape, dtype, device, seed: int) -> Weights:
    """Seeded random weights of ``shape``.

    Normals scaled by 1/sqrt(fan_in) (embedding: unit normals; norms: 1 + 0.1 x normal, so a
    wrongly applied norm weight shows), generated on ``device`` in ``dtype`` one tensor at a time
    (a 16 GB model needs no host copy).

    Parameters
    ----------
    shape : ModelShape
    dtype : torch.dtype
    device : str or torch.device
    seed : int

    Returns
    -------
    Weights
        Shapes as in :class:`Weights`, all ``dtype`` on ``device``.
    """
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    H, L, I, V = shape.hidden_size, shape.num_layers, shape.intermediate_size, shape.vocab_size
    A = shape.num_heads * shape.head_dim

    def normal(*size, scale=1.0, offset=0.0):
        t = torch.randn(size, generator=gen, device=device, dtype=dtype)
        if scale != 1.0:
            t.mul_(scale)
        return t.add_(offset) if offset else t

    return Weights(
        embed=normal(V, H),
        attn_norm=normal(L, H, scale=0.1, offset=1.0),
        qkv=normal(L, shape.qkv_size, H, scale=H ** -0.5),
        o=normal(L, H, A, scale=A ** -0.5),
        mlp_norm=normal(L, H, scale=0.1, offset=1.0),
        gate_up=normal(L, 2 * I, H, scale=H ** -0.5),
        down=normal(L, H, I, scale=I ** -0.5),
        norm=normal(H, scale=0.1, offset=1.0),
        lm_head=normal(V, H, scale=H ** -0.5),
    )


# -- rotary embedding -------------------------------------------------------------------------
def inv_freq(head_dim: int, theta: float, device):
    """float32 [D/2]: 1 / theta^(2i / D), as LlamaRotaryEmbedding computes it."""
    import torch

    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rotary_cos_sin(positions, inv_freq_, dtype):
    """(cos, sin), each [T, D] in ``dtype``, for int positions [T]."""
    import torch

    freqs = positions[:, None].float() * inv_freq_[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x, cos, sin):
    """x [T, H, D] rotated by cos, sin [T, D] (rotate-half)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


# -- the kernels of the non-attention part ------------------------------------------------------
class Kernels:
    """RMSNorm, residual add + RMSNorm, rotary embedding, SiLU-and-mul, projections and the K/V
    append, by torch, FlashInfer or FlashInfer plus our step kernels (``pkv``).

    ``add_rmsnorm(delta, residual, w)`` adds ``delta`` into the residual stream in place and
    returns its norm (FlashInfer's fused_add_rmsnorm, which writes the norm into ``delta``).
    ``rotary(qkv, positions)`` returns q [T, Hq, D] and k [T, Hkv, D], both contiguous.
    ``linear(x, w)`` is ``F.linear(x, w)``; ``gate_up_silu(h, w)`` is
    ``silu_mul(F.linear(h, w))``; ``append(k_flat, v_flat, slots, k, v)`` writes k and v into the
    cache rows ``slots``. ``pkv`` runs them as step_ops kernels where those take the inputs.
    """

    def __init__(self, name: str, shape: ModelShape, device, max_position: int = 0):
        require(name in KERNEL_CHOICES, f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {name!r}")
        device = resolve_device(device)
        if name == "auto":
            name = auto_kernels(device.type)
        if name in ("flashinfer", "pkv"):
            require(device.type == "cuda", f"kernels={name} needs a CUDA device, got {device}")
            reasons = missing_module("flashinfer") + (missing_module("cupy") if name == "pkv" else [])
            require(not reasons, f"kernels={name}: {'; '.join(reasons)}")
        self.name = name
        self.shape = shape
        self.eps = float(shape.rms_norm_eps)
        self.inv_freq = inv_freq(shape.head_dim, shape.rope_theta, device)
        self._flashinfer = name in ("flashinfer", "pkv")  # pkv: FlashInfer's norms and rotary
        self._table = None
        self._outgrown: list = []  # earlier tables: a captured graph may still read one
        if self._flashinfer:
            self._grow_table(max(1, max_position))

    def _grow_table(self, positions: int) -> None:
        """FlashInfer's cos|sin table (float32 [positions, D]: cos of the D/2 frequencies, then
        sin), from the same float32 products as rotary_cos_sin, so both paths rotate alike."""
        import torch

        if self._table is not None and self._table.shape[0] >= positions:
            return
        if self._table is not None:
            self._outgrown.append(self._table)
        pos = torch.arange(positions, device=self.inv_freq.device)
        freqs = pos[:, None].float() * self.inv_freq[None, :]
        self._table = torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()

    def reserve_positions(self, positions: int) -> None:
        """Make the rotary table cover ``positions`` (call outside a graph capture)."""
        if self._flashinfer:
            self._grow_table(positions)

    def rmsnorm(self, x, weight):
        if self._flashinfer:
            from flashinfer.norm import rmsnorm

            return rmsnorm(x, weight, self.eps)
        import torch

        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(dtype)

    def add_rmsnorm(self, delta, residual, weight):
        if self._flashinfer:
            from flashinfer.norm import fused_add_rmsnorm

            fused_add_rmsnorm(delta, residual, weight, self.eps)
            return delta
        residual.add_(delta)
        return self.rmsnorm(residual, weight)

    def rotary(self, qkv, positions):
        s = self.shape
        T, D = qkv.shape[0], s.head_dim
        a, kv = s.num_heads * D, s.num_kv_heads * D
        if self._flashinfer:
            from flashinfer.rope import apply_rope_with_cos_sin_cache

            q, k = apply_rope_with_cos_sin_cache(positions, qkv[:, :a], qkv[:, a:a + kv], D, self._table, is_neox=True)
            return q.view(T, s.num_heads, D), k.view(T, s.num_kv_heads, D)
        cos, sin = rotary_cos_sin(positions, self.inv_freq, qkv.dtype)
        q = apply_rotary(qkv[:, :a].view(T, s.num_heads, D), cos, sin)
        k = apply_rotary(qkv[:, a:a + kv].view(T, s.num_kv_heads, D), cos, sin)
        return q, k

    def silu_mul(self, gate_up):
        if self._flashinfer:
            from flashinfer.activation import silu_and_mul

            return silu_and_mul(gate_up)
        import torch.nn.functional as F

        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def linear(self, x, w):
        """``F.linear(x, w)``: x [T, K], w [N, K] -> [T, N]; pkv: step_ops.gemv at T = 1."""
        if self._takes_gemv(x, w, silu=False):
            return step_ops.launch_gemv(x, w)
        import torch.nn.functional as F

        return F.linear(x, w)

    def gate_up_silu(self, h, w):
        """``silu_mul(F.linear(h, w))`` for w = [gate | up] [2I, H]: h [T, H] -> [T, I]; pkv:
        step_ops.gemv_silu_mul at T = 1."""
        if self._takes_gemv(h, w, silu=True):
            return step_ops.launch_gemv(h, w, silu=True)
        import torch.nn.functional as F

        return self.silu_mul(F.linear(h, w))

    def _takes_gemv(self, x, w, silu: bool) -> bool:
        """pkv, and step_ops' gemv takes x and w (the row count tested first: a prefill's T > 1
        goes to cuBLAS without the full check)."""
        return (self.name == "pkv" and x.dim() == 2 and x.shape[0] <= step_ops.MAX_ROWS
                and not step_ops.gemv_unsupported(x, w, silu=silu))

    def append(self, k_flat, v_flat, slots, k, v, k_scale=None, v_scale=None) -> None:
        """``k_flat[slots] = k``, ``v_flat[slots] = v`` (k, v [T, Hkv, D]; caches [S, Hkv, D];
        slots int64 [T]); into an FP8 cache (``k_scale``/``v_scale`` float32 [1] or [Hkv]) the e4m3
        codes of k / k_scale and v / v_scale, saturated at +-448; pkv: one step_ops.append_kv."""
        if self.name == "pkv" and not step_ops.append_kv_unsupported(k_flat, v_flat, slots, k, v, k_scale, v_scale):
            step_ops.launch_append_kv(k_flat, v_flat, slots, k, v, k_scale, v_scale)
            return
        if k_scale is not None:
            from ..fp8 import store_e4m3

            store_e4m3(k_flat, slots, k, k_scale)
            store_e4m3(v_flat, slots, v, v_scale)
            return
        k_flat.index_copy_(0, slots, k)
        v_flat.index_copy_(0, slots, v)


# -- sampling on the device ---------------------------------------------------------------------
#: Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so the hash below
#: never overflows int64 on any device (CPU and CUDA give the same bits).
_MIX = (0x7FEB352D, 0x68E31DA5, 0x2C1B3C6D)
_M32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding 32-bit values."""
    for c in _MIX:
        x = ((x ^ (x >> 16)) * c) & _M32
    return x ^ (x >> 16)


def uniform_noise(seed: int, keys, positions, count: int):
    """float64 [B, count] in (0, 1) (never 0 or 1: 2**-33 away at most), a pure function of
    (seed, key, position, column): the same request at the same position draws the same numbers
    in any batch, on any device."""
    import torch

    h = _mix32((keys.to(torch.int64) & _M32) ^ (int(seed) & _M32))
    h = _mix32((h + (positions.to(torch.int64) & _M32)) & _M32)
    cols = torch.arange(count, device=keys.device, dtype=torch.int64)
    h = _mix32((h[:, None] + cols[None, :] * 0x9E3779B1) & _M32)
    return (h.to(torch.float64) + 0.5) / 4294967296.0


def sample(logits, top_k: int, seed: int, keys, positions, temperature: float = 1.0):
    """Next tokens: greedy, or one seeded draw from the top k.

    ``top_k`` = 1 is the argmax; otherwise one draw from the softmax of the ``top_k`` largest
    logits / ``temperature`` by the Gumbel-max trick, with noise from :func:`uniform_noise` (no
    generator state: a CUDA graph replays it exactly, and the same positions draw the same tokens).

    Parameters
    ----------
    logits : torch.Tensor
        [B, V], any float dtype.
    top_k : int
        Candidates per row (1: greedy).
    seed : int
        The draw's seed.
    keys : torch.Tensor
        int [B], each row's request id.
    positions : torch.Tensor
        int [B], each row's position.
    temperature : float
        Divides the logits before the draw.

    Returns
    -------
    torch.Tensor
        int64 [B] token ids.
    """
    import torch

    if top_k == 1:
        return logits.argmax(dim=-1)
    values, index = torch.topk(logits.float(), top_k, dim=-1)
    gumbel = -torch.log(-torch.log(uniform_noise(seed, keys, positions, top_k)))
    choice = (values.double() / temperature + gumbel).argmax(dim=-1, keepdim=True)
    return index.gather(1, choice).squeeze(1)


@dataclass(frozen=True)
class Sampling:
    """Greedy (top_k = 1) or seeded top-k sampling."""

    top_k: int = 1
    seed: int = 0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise PKVError(f"top_k must be a positive integer, got {self.top_k!r}")
        require(self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
