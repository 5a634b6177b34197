"""AttentionSpec: the shape of one decode-attention problem, validated once."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .errors import PKVError, require

HEAD_DIMS = (64, 128, 256)
MAX_PAGE_SIZE = 256
#: dtype name -> bytes per element. float16/bfloat16 are the serving dtypes; float32/float64
#: exist for the NumPy executor (exactness tests).
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
LAYOUTS = ("NHD",)


def is_power_of_two(value: int) -> bool:
    return value >= 1 and (value & (value - 1)) == 0


@dataclass(frozen=True)
class AttentionSpec:
    """Decode attention over a paged KV cache.

    K and V are each ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD); queries are
    ``[batch, num_qo_heads, head_dim]``; query head ``j`` reads KV head ``j // group_size``.
    """

    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "float16"
    layout: str = "NHD"

    def __post_init__(self) -> None:
        for field in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise PKVError(f"{field} must be an integer, got {value!r}")
            require(value >= 1, f"{field} must be >= 1, got {value}")
        require(self.num_qo_heads % self.num_kv_heads == 0,
                f"num_qo_heads={self.num_qo_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        require(self.head_dim in HEAD_DIMS, f"head_dim={self.head_dim} is not one of {HEAD_DIMS}")
        require(is_power_of_two(self.page_size) and self.page_size <= MAX_PAGE_SIZE,
                f"page_size={self.page_size} is not a power of two in [1, {MAX_PAGE_SIZE}]")
        require(self.dtype in DTYPE_BYTES, f"dtype={self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        require(self.layout in LAYOUTS, f"layout={self.layout!r} is not one of {LAYOUTS}")

    @property
    def group_size(self) -> int:
        """G = Hq / Hkv: query heads that share one KV head."""
        return self.num_qo_heads // self.num_kv_heads

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K plus V for one token over all KV heads (what one decode step reads per token)."""
        return 2 * self.num_kv_heads * self.head_dim * self.itemsize

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "AttentionSpec":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        require(not unknown, f"unknown AttentionSpec field(s): {', '.join(unknown)}")
        return cls(**data)
