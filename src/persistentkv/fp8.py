"""FP8 e4m3 KV caches on the host: the codes, their values, quantisation and the scales' checks.

An FP8 cache holds e4m3 codes (torch.float8_e4m3fn; NumPy keeps them as uint8); a stored code c
of KV head h stands for ``value(c) * scale[h]``, the scale per tensor (one value) or per KV head
([Hkv]), float32, finite and > 0. Everything that reads a cache on the host (the float64
reference, the NumPy executor, the validation) dequantises with :func:`dequantize`; the engine
dequantises the same codes in registers (kernels/pkv_decode.cu) and the decode step quantises
new tokens on the device as :func:`quantize` does here (round to nearest even, saturating at
+-448, so an overflow never becomes inf or NaN).

e4m3 ("fn": finite, no infinities): sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
holds the subnormals m/8 x 2^-6; 0x7F and 0xFF are NaN; the largest finite value is 448.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from .errors import require

#: The largest finite e4m3 value.
E4M3_MAX = 448.0
#: The e4m3 NaN codes (S.1111.111).
NAN_CODES = (0x7F, 0xFF)


@lru_cache(maxsize=None)
def code_values() -> np.ndarray:
    """float64 [256]: the value of every e4m3 code (NaN at :data:`NAN_CODES`). Read-only."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    values = sign * np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    values[list(NAN_CODES)] = np.nan
    values.setflags(write=False)
    return values


@lru_cache(maxsize=None)
def _positive_grid() -> np.ndarray:
    """float64 [127]: the finite non-negative values, ascending (code c has value grid[c])."""
    grid = code_values()[:0x7F].copy()
    assert np.all(np.diff(grid) > 0)
    return grid


def quantize(values, scale=1.0, head_axis: int | None = None) -> np.ndarray:
    """The e4m3 codes (uint8, ``values``' shape) of ``values / scale``: rounded to the nearest
    code, ties to the even code, saturating at +-448 (an overflow stays finite); NaN stays NaN.

    Parameters
    ----------
    values : array_like
        Real values (any float dtype; computed in float64).
    scale : float or array_like
        One scale, or one per KV head (``head_axis`` says which axis of ``values`` is the head).
    head_axis : int, optional
        The axis of ``values`` the per-head scales run along (e.g. 2 for a cache
        [pages, P, Hkv, D]); required with per-head scales.
    """
    x = np.asarray(values, dtype=np.float64) / _broadcast_scale(scale, np.ndim(values), head_axis)
    magnitude = np.minimum(np.abs(x), E4M3_MAX)
    grid = _positive_grid()
    upper = np.clip(np.searchsorted(grid, magnitude, side="left"), 0, grid.size - 1)
    lower = np.maximum(upper - 1, 0)
    d_up, d_low = grid[upper] - magnitude, magnitude - grid[lower]
    # nearest; on a tie the even code (the one whose mantissa's last bit is 0)
    pick_low = (d_low < d_up) | ((d_low == d_up) & (lower % 2 == 0))
    code = np.where(pick_low, lower, upper).astype(np.uint8)
    code = np.where(magnitude == grid[upper], upper, code).astype(np.uint8)  # exact values
    code = code | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(x), np.uint8(0x7F), code).astype(np.uint8)


def dequantize(codes, scale=1.0, head_axis: int | None = None, dtype=np.float64) -> np.ndarray:
    """``value(codes) * scale`` in ``dtype``: the values an FP8 cache stands for.

    Parameters
    ----------
    codes : array_like of uint8
        e4m3 codes (a NumPy view of a torch.float8_e4m3fn tensor: ``t.view(torch.uint8)``).
    scale, head_axis
        As :func:`quantize`.
    """
    codes = np.asarray(codes)
    require(codes.dtype == np.uint8, f"FP8 codes must be uint8, got {codes.dtype}")
    values = code_values()[codes] * _broadcast_scale(scale, codes.ndim, head_axis)
    return values.astype(dtype, copy=False)


def _broadcast_scale(scale, ndim: int, head_axis: int | None) -> np.ndarray | float:
    array = np.asarray(scale, dtype=np.float64)
    if array.size == 1:
        return float(array.reshape(()))
    require(array.ndim == 1 and head_axis is not None,
            f"per-head scales must be one value per KV head along head_axis, got shape {list(array.shape)}")
    shape = [1] * ndim
    shape[head_axis] = array.size
    return array.reshape(shape)


def scale_reasons(name: str, scale, num_kv_heads: int) -> list[str]:
    """Why ``scale`` is not a usable host scale (one float, or float32 [1] / [Hkv] of finite values
    > 0); [] when it is. For host arrays and Python floats; the engine checks device tensors."""
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        values = np.array([float(scale)])
    else:
        values = np.asarray(scale)
        if values.dtype.kind != "f":
            return [f"{name} must be floating point, got {values.dtype}"]
        if values.ndim > 1 or values.size not in (1, num_kv_heads):
            return [f"{name} must hold one value or one per KV head ({num_kv_heads}), got shape {list(values.shape)}"]
    bad = [float(x) for x in values.reshape(-1) if not (math.isfinite(float(x)) and float(x) > 0)]
    if bad:
        return [f"{name} must be finite and > 0, got {bad[0]!r}"]
    return []


def fit_scale(values, head_axis: int | None = None) -> np.ndarray:
    """float32 scales that map ``values``' largest magnitude to 448 (the usual calibration of an
    FP8 cache): one per tensor (``head_axis`` None, shape [1]) or one per KV head along
    ``head_axis``; an all-zero tensor or head gets scale 1."""
    x = np.abs(np.asarray(values, dtype=np.float64))
    if head_axis is None:
        amax = np.array([x.max() if x.size else 0.0])
    else:
        amax = np.moveaxis(x, head_axis, 0).reshape(x.shape[head_axis], -1).max(axis=1)
    return np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)


def quantize_e4m3(values, scale):
    """The e4m3 codes (torch.float8_e4m3fn) of ``values / scale`` (``scale`` broadcast), rounded to
    nearest even and saturated at +-448 (torch's own cast of a larger value is NaN on the GPU): a
    decode step's append outside the step_ops kernel (which rounds once, from the exact quotient;
    here the float32 quotient is rounded first)."""
    import torch

    return (values.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def store_e4m3(flat, slots, values, scale) -> None:
    """``flat[slots] = quantize_e4m3(values, scale)`` for a cache's rows ``flat`` [S, Hkv, D] of
    float8_e4m3fn, ``values`` [T, Hkv, D], ``scale`` float32 [1] or [Hkv]; the codes are copied as
    bytes (torch's index_copy_ has no float8 kernel on the CPU)."""
    import torch

    codes = quantize_e4m3(values, scale.view(1, -1, 1))
    flat.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))
