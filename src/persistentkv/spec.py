"""AttentionSpec: the shape of one decode-attention problem, validated once."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace

import numpy as np

from .errors import PKVError, require
from .names import FP8_KV

HEAD_DIMS = (64, 128, 256)
MAX_PAGE_SIZE = 256
#: dtype name -> bytes per element. float16/bfloat16 are the serving dtypes; float32/float64
#: exist for the NumPy executor (exactness tests).
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
#: FP8_KV (persistentkv.names), the quantised KV-cache format: FP8 e4m3 (torch.float8_e4m3fn; NumPy
#: holds its codes as uint8), dequantised as code value x scale (per tensor or per KV head). Queries
#: and outputs stay in ``dtype``.
#: kv_dtype name -> bytes per element of K and V.
KV_DTYPE_BYTES = {**DTYPE_BYTES, FP8_KV: 1}
LAYOUTS = ("NHD",)
#: The longest row (tokens) the engine addresses: its kernel computes a tile's token indices in
#: int32, up to ``N + TILE - 1`` for a row of ``N`` tokens, and a tile is at most 128 tokens (the
#: 8-warp module's stage), so ``N <= 2**31 - 128`` keeps every index below ``2**31``. Plans store
#: token bounds as int32 too. Batches and traces refuse longer rows.
MAX_SEQ_LEN = 2**31 - 128


def is_integer(value: object) -> bool:
    """A Python or NumPy integer, and not a bool (which Python counts as an int)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def integer_array(name: str, value, low: int, high: int) -> np.ndarray:
    """``value`` as a 1-D NumPy integer array whose elements lie in ``[low, high]``.

    Parameters
    ----------
    name : str
        What the caller calls ``value``, for the error message.
    value : array_like
        Integer values (a list, a tuple or an array of any integer dtype).
    low, high : int
        The accepted range, both ends included.

    Returns
    -------
    numpy.ndarray
        ``value``'s elements, shape [n], in their own integer dtype (an empty ``value`` gives
        int64 [0]); every element is in range, so a cast to a narrower integer type is exact.

    Raises :class:`PKVError` (one line naming ``name``, the value and what is accepted) for
    ragged nested lists, more than one dimension, a non-integer dtype (a float page id is
    refused, never truncated; bool too) and a value out of range. Vectorised: a few NumPy passes,
    no Python loop over the elements.
    """
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):  # ragged nested lists, objects NumPy cannot stack
        raise PKVError(f"{name} must be a 1-D array of integers, got ragged {_short(value)}") from None
    # if/raise, not require(): these messages format the array, which costs more than the checks
    if array.ndim != 1:
        raise PKVError(f"{name} must be a 1-D array of integers, got shape {array.shape}: {_short(value)}")
    if array.size == 0:
        return array.astype(np.int64)  # [] reads as float64; an empty list of integers is still integers
    if array.dtype.kind not in "iu":
        raise PKVError(f"{name} must be integers, got {array.dtype} values such as {_short(array[:1].tolist()[0])}")
    if array.min() < low or array.max() > high:
        first = int(np.flatnonzero((array < low) | (array > high))[0])
        raise PKVError(f"{name}[{first}] = {array[first]} is out of range [{low}, {high}]")
    return array


def _short(value, limit: int = 40) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def is_power_of_two(value: int) -> bool:
    return value >= 1 and (value & (value - 1)) == 0


@dataclass(frozen=True)
class AttentionSpec:
    """Decode attention over a paged KV cache: the shape every tensor of a step has.

    Parameters
    ----------
    num_qo_heads : int
        Query heads Hq (a multiple of ``num_kv_heads``).
    num_kv_heads : int
        KV heads Hkv; query head ``j`` reads KV head ``j // group_size`` (G = Hq / Hkv).
    head_dim : int
        D, one of HEAD_DIMS (64, 128, 256).
    page_size : int
        Tokens per page P, a power of two up to MAX_PAGE_SIZE.
    dtype : str
        Element type of Q and the output (and of K and V unless ``kv_dtype`` says otherwise):
        ``float16``, ``bfloat16``, ``float32``, ``float64`` (the engine takes the first two; the
        references all four).
    layout : str
        ``NHD``: K and V are each ``[num_pages, page_size, num_kv_heads, head_dim]``; queries and
        outputs are ``[batch, num_qo_heads, head_dim]``.
    kv_dtype : str, optional
        Element type of K and V when it is not ``dtype``: ``float8_e4m3`` (:data:`FP8_KV`: the
        cache holds FP8 codes dequantised as code x scale, the scales given per tensor or per KV
        head with each run). None (the default; ``dtype`` itself is stored as None): the query's
        dtype. :attr:`cache_dtype` is the cache's dtype either way.

    Anything else is refused with a one-line PKVError when the spec is built.
    """

    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "float16"
    layout: str = "NHD"
    kv_dtype: str | None = None

    def __post_init__(self) -> None:
        for field in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, field)
            require(is_integer(value), f"{field} must be an integer, got {value!r}")
            require(value >= 1, f"{field} must be >= 1, got {value}")
            object.__setattr__(self, field, int(value))  # a NumPy integer would not serialise to JSON
        require(self.num_qo_heads % self.num_kv_heads == 0,
                f"num_qo_heads={self.num_qo_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        require(self.head_dim in HEAD_DIMS, f"head_dim={self.head_dim} is not one of {HEAD_DIMS}")
        require(is_power_of_two(self.page_size) and self.page_size <= MAX_PAGE_SIZE,
                f"page_size={self.page_size} is not a power of two in [1, {MAX_PAGE_SIZE}]")
        # isinstance first: an unhashable value (a list) would raise TypeError inside ``in``
        require(isinstance(self.dtype, str) and self.dtype in DTYPE_BYTES,
                f"dtype={self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        require(isinstance(self.layout, str) and self.layout in LAYOUTS,
                f"layout={self.layout!r} is not one of {LAYOUTS}")
        require(self.kv_dtype in (None, self.dtype, FP8_KV),
                f"kv_dtype={self.kv_dtype!r}: the cache holds {self.dtype} (the query dtype) or {FP8_KV}")
        if self.kv_dtype == self.dtype:  # one spelling of "the query's dtype": None (so replace(dtype=) follows it)
            object.__setattr__(self, "kv_dtype", None)

    @property
    def group_size(self) -> int:
        """G = Hq / Hkv: query heads that share one KV head."""
        return self.num_qo_heads // self.num_kv_heads

    @property
    def itemsize(self) -> int:
        """Bytes per element of Q and the output."""
        return DTYPE_BYTES[self.dtype]

    @property
    def cache_dtype(self) -> str:
        """The dtype of K and V: ``kv_dtype``, or ``dtype`` when it is None."""
        return self.kv_dtype or self.dtype

    @property
    def kv_itemsize(self) -> int:
        """Bytes per element of K and V."""
        return KV_DTYPE_BYTES[self.cache_dtype]

    @property
    def fp8_kv(self) -> bool:
        """Whether K and V are FP8 codes (kv_dtype float8_e4m3) read with scales."""
        return self.kv_dtype == FP8_KV

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K plus V for one token over all KV heads (what one decode step reads per token)."""
        return 2 * self.num_kv_heads * self.head_dim * self.kv_itemsize

    def to_dict(self) -> dict:
        data = asdict(self)
        if self.kv_dtype is None:  # the cache of the query's dtype: the spec as it always read
            del data["kv_dtype"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "AttentionSpec":
        require(isinstance(data, Mapping), f"an AttentionSpec is read from a mapping of its fields, got {data!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(key) for key in set(data) - known)
        require(not unknown, f"unknown AttentionSpec field(s): {', '.join(unknown)}")
        return cls(**data)


def shapes_tokens(nbytes: int, batch_size: int, spec: AttentionSpec, max_tokens: int) -> int | None:
    """Tokens per row that make B equal rows read ``nbytes`` of K/V: nbytes / (B x kv_bytes_per_token),
    rounded to the nearest whole page; None when that is under one page or over ``max_tokens``.
    Worked number: 16 MiB at B=4, Hkv=2, D=128, fp16 (1 KiB per token) -> 4096 tokens per row."""
    require(nbytes > 0 and batch_size >= 1, f"need positive bytes and batch size, got {nbytes}, {batch_size}")
    exact = nbytes / (batch_size * spec.kv_bytes_per_token)
    tokens = int(round(exact / spec.page_size)) * spec.page_size
    if tokens < spec.page_size or tokens > max_tokens:
        return None
    return tokens


def shapes_cells(base: AttentionSpec,
                 grid: Mapping) -> Iterator[tuple[int, int, int, float, AttentionSpec, int | None]]:
    """Each cell of a bench_shapes grid (config ``measure.bench_shapes``: kv_heads x group_sizes x
    batch_sizes x kv_mib, in that order) as (Hkv, G, B, MiB, its spec, its tokens per row): the spec
    is ``base`` with Hkv KV heads and Hq = G x Hkv; the tokens are :func:`shapes_tokens`' (None: the
    cell does not fit under the grid's max_tokens_per_row or one page)."""
    limit = int(grid["max_tokens_per_row"])
    for hkv in grid["kv_heads"]:
        for g in grid["group_sizes"]:
            spec = replace(base, num_kv_heads=int(hkv), num_qo_heads=int(g) * int(hkv))
            for b in grid["batch_sizes"]:
                for mib in grid["kv_mib"]:
                    tokens = shapes_tokens(int(round(float(mib) * 2**20)), int(b), spec, limit)
                    yield int(hkv), int(g), int(b), mib, spec, tokens
