"""Model shapes from config/config.yaml (``models:``) and the bytes a configuration needs.

A :class:`ModelShape` is a Llama-architecture decoder: ``num_layers`` blocks of RMSNorm, fused QKV
projection, rotary embedding, paged attention, O projection, RMSNorm and SwiGLU MLP, then a final
RMSNorm and the LM head. ``hidden_size`` need not equal ``num_heads * head_dim`` (the projections
map between them, as Hugging Face's LlamaAttention does).

``tensor_parallel`` > 1 marks the per-GPU shard of a larger model: heads, MLP width and vocabulary
divided by the degree, hidden size kept. One GPU runs the shard alone, so the all-reduces after
the O and down projections (and the logits gather) are not in its step; the entry's ``note`` says
so wherever the shape is reported.

Worked number (Llama-3-8B, fp16): a layer holds 4096 x 6144 (QKV) + 4096 x 4096 (O) +
4096 x 28672 (gate|up) + 14336 x 4096 (down) = 218 M parameters; 32 layers and the 128256 x 4096
LM head make 7.50 G parameters read per step (15.0 GB), and each cached token costs
2 x 32 x 8 x 128 x 2 = 128 KiB of K and V over the layers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..errors import PKVError, require
from ..spec import DTYPE_BYTES, KV_DTYPE_BYTES, AttentionSpec

#: Bytes a step keeps beside weights and cache for each backend's own buffers: FlashInfer's and
#: XQA's float workspaces (256 MiB each, backends/*_backend.py WORKSPACE_BYTES) and room for the
#: others' plans and partial states (tens of MB at B <= 64).
BACKEND_WORKSPACE_BYTES = 256 * 2**20
#: Free memory a configuration may use: the rest covers CUDA graphs' private pools, cuBLAS
#: workspaces and fragmentation of the caching allocator.
FIT_FRACTION = 0.92


@dataclass(frozen=True)
class ModelShape:
    """One decoder's dimensions (``models.<name>`` in the config)."""

    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    tensor_parallel: int = 1
    note: str = ""

    def __post_init__(self) -> None:
        for field in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "num_layers", "intermediate_size",
                      "vocab_size", "tensor_parallel"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PKVError(f"model {self.name}: {field} must be a positive integer, got {value!r}")
        require(self.num_heads % self.num_kv_heads == 0,
                f"model {self.name}: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        require(self.head_dim % 2 == 0, f"model {self.name}: head_dim={self.head_dim} must be even (rotary halves)")
        require(self.rope_theta > 1 and self.rms_norm_eps > 0,
                f"model {self.name}: rope_theta must be > 1 and rms_norm_eps > 0")

    # -- sizes --------------------------------------------------------------------------------
    @property
    def qkv_size(self) -> int:
        """Output width of the fused QKV projection: [q | k | v] heads of head_dim."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def layer_params(self) -> int:
        H, A = self.hidden_size, self.num_heads * self.head_dim
        return H * self.qkv_size + A * H + 2 * H * self.intermediate_size + self.intermediate_size * H + 2 * H

    def params(self) -> int:
        """Every weight: layers, final norm, embedding and LM head (untied)."""
        return self.num_layers * self.layer_params() + self.hidden_size + 2 * self.vocab_size * self.hidden_size

    def weight_bytes(self, dtype: str) -> int:
        return self.params() * DTYPE_BYTES[dtype]

    def step_weight_bytes(self, dtype: str, batch_size: int) -> int:
        """Weight bytes one decode step must read: every layer, the final norm, the LM head, and
        the embedding rows of its ``batch_size`` tokens (not the whole table)."""
        read = self.num_layers * self.layer_params() + self.hidden_size + self.vocab_size * self.hidden_size
        return (read + batch_size * self.hidden_size) * DTYPE_BYTES[dtype]

    def step_matrices(self, dtype: str) -> dict[str, tuple[int, int]]:
        """The weight matrices a decode step reads, name -> (bytes of one, how many per step):
        each layer's qkv, o, gate_up and down, and the LM head. With the norms' weights and the
        embedding rows they make up :meth:`step_weight_bytes`."""
        H, A, I, L, b = (self.hidden_size, self.num_heads * self.head_dim, self.intermediate_size,
                         self.num_layers, DTYPE_BYTES[dtype])
        return {"qkv": (self.qkv_size * H * b, L), "o": (H * A * b, L), "gate_up": (2 * I * H * b, L),
                "down": (H * I * b, L), "lm_head": (self.vocab_size * H * b, 1)}

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V of one cached token over every layer; ``dtype`` the cache's (``float8_e4m3``: 1 byte)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * KV_DTYPE_BYTES[dtype]

    def attention_spec(self, page_size: int, dtype: str, kv_dtype: str | None = None) -> AttentionSpec:
        """The per-layer attention problem (one AttentionSpec shared by every layer); ``kv_dtype``
        ``float8_e4m3`` for an FP8 cache."""
        return AttentionSpec(self.num_heads, self.num_kv_heads, self.head_dim, page_size, dtype, kv_dtype=kv_dtype)

    def to_dict(self) -> dict:
        return asdict(self)


#: Keys of a ``models.<name>`` entry that are not dimensions.
_NOT_SHAPE = ("cases", "traces")


def model_shape(config: dict, name: str) -> ModelShape:
    """The ``models.<name>`` entry of a validated config as a ModelShape."""
    models = config.get("models") or {}
    require(name in models, f"model {name!r} is not in the config's models (known: {', '.join(models) or 'none'})")
    entry = {k: v for k, v in models[name].items() if k not in _NOT_SHAPE}
    return ModelShape(name=name, **entry)


def model_cases(config: dict, name: str) -> list[tuple[int, int]]:
    """(batch size, context) cells of ``models.<name>.cases``, batch-major; [] when it has none."""
    cases = (config.get("models") or {}).get(name, {}).get("cases")
    if not cases:
        return []
    return [(int(b), int(n)) for b in cases["batch_sizes"] for n in cases["contexts"]]


def model_traces(config: dict, name: str, default: list[str]) -> list[str]:
    """The traces ``models.<name>.traces`` follows in measure-e2e; ``default`` (the config's
    generated traces) when the model names none. Every name must be a trace of the config."""
    entry = (config.get("models") or {}).get(name, {})
    if "traces" not in entry:
        return list(default)
    known = [t["name"] for t in config.get("traces", [])]
    unknown = [t for t in entry["traces"] if t not in known]
    require(not unknown, f"models.{name}.traces: {', '.join(unknown)} is not a trace of the config "
                         f"(traces: {', '.join(known)})")
    return list(entry["traces"])


@dataclass(frozen=True)
class Footprint:
    """Device bytes of one configuration, computed before anything is allocated."""

    weights: int
    kv_cache: int
    workspaces: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.workspaces


def footprint(shape: ModelShape, dtype: str, num_pages: int, page_size: int, batch_size: int,
              backends: int = 1, kv_dtype: str | None = None) -> Footprint:
    """The device bytes of one configuration, before anything is allocated.

    Parameters
    ----------
    shape : ModelShape
    dtype : str
        The weights' and the cache's dtype name (spec.DTYPE_BYTES).
    num_pages, page_size : int
        One paged cache of ``num_pages`` pages per layer.
    batch_size : int
        Rows of the step (its activations: the largest are the fused MLP output [B, 2I] and
        the float32 logits [B, V]).
    backends : int
        Loops (each with its workspace, BACKEND_WORKSPACE_BYTES, and its activations).
    kv_dtype : str or None
        The cache's dtype when it is not ``dtype`` (``float8_e4m3``).

    Returns
    -------
    Footprint
    """
    item = DTYPE_BYTES[dtype]
    weights = shape.weight_bytes(dtype)
    kv = 2 * shape.num_layers * num_pages * page_size * shape.num_kv_heads * shape.head_dim \
        * KV_DTYPE_BYTES[kv_dtype or dtype]
    activations = batch_size * (6 * shape.hidden_size + shape.qkv_size + 3 * shape.intermediate_size) * item \
        + batch_size * shape.vocab_size * (item + 8)
    return Footprint(weights, kv, backends * (BACKEND_WORKSPACE_BYTES + activations))


def check_fits(need: Footprint, free_bytes: int, what: str) -> None:
    """One line, before any allocation, when ``need`` exceeds the usable free device memory."""
    usable = FIT_FRACTION * free_bytes
    if need.total > usable:
        gib = 2.0 ** 30
        weights = f"weights {need.weights / gib:.1f}" if need.weights else "the weights already on the device"
        raise PKVError(f"{what} needs {need.total / gib:.1f} GiB ({weights}, KV cache "
                       f"{need.kv_cache / gib:.1f}, workspaces {need.workspaces / gib:.1f}) but "
                       f"{usable / gib:.1f} GiB of the device's {free_bytes / gib:.1f} GiB free is usable; "
                       f"use a smaller batch or context")


def pages_for(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)
