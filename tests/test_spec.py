"""AttentionSpec: the valid grid, derived sizes, and one-line errors for every invalid field."""

from __future__ import annotations

import itertools

import pytest

from persistentkv.errors import PKVError
from persistentkv.spec import DTYPE_BYTES, HEAD_DIMS, AttentionSpec, is_power_of_two

PAGE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


@pytest.mark.parametrize("page_size, head_dim, heads",
                         list(itertools.product(PAGE_SIZES, HEAD_DIMS, [(32, 8), (8, 8), (64, 8), (12, 4), (1, 1)])))
def test_valid_grid(page_size, head_dim, heads):
    hq, hkv = heads
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim=head_dim, page_size=page_size)
    assert spec.group_size == hq // hkv >= 1
    assert spec.kv_bytes_per_token == 2 * hkv * head_dim * 2  # K and V, FP16


def test_published_spec_sizes():
    spec = AttentionSpec()  # Hq=32, Hkv=8, D=128, page 16, FP16
    assert (spec.group_size, spec.itemsize, spec.kv_bytes_per_token) == (4, 2, 4096)
    for dtype, size in DTYPE_BYTES.items():
        assert AttentionSpec(dtype=dtype).kv_bytes_per_token == 2 * 8 * 128 * size


@pytest.mark.parametrize("kwargs, message", [
    ({"page_size": 3}, "page_size=3 is not a power of two"),
    ({"page_size": 24}, "page_size=24 is not a power of two"),
    ({"page_size": 512}, "page_size=512 is not a power of two in \\[1, 256\\]"),
    ({"page_size": 0}, "page_size must be >= 1, got 0"),
    ({"num_qo_heads": 30, "num_kv_heads": 8}, "num_qo_heads=30 is not a multiple of num_kv_heads=8"),
    ({"num_qo_heads": 4, "num_kv_heads": 8}, "num_qo_heads=4 is not a multiple of num_kv_heads=8"),
    ({"head_dim": 96}, "head_dim=96 is not one of"),
    ({"head_dim": 0}, "head_dim must be >= 1, got 0"),
    ({"num_kv_heads": 0}, "num_kv_heads must be >= 1, got 0"),
    ({"num_qo_heads": -4}, "num_qo_heads must be >= 1, got -4"),
    ({"head_dim": 128.0}, "head_dim must be an integer, got 128.0"),
    ({"page_size": True}, "page_size must be an integer, got True"),
    ({"dtype": "int8"}, "dtype='int8' is not one of"),
    ({"layout": "HND"}, "layout='HND' is not one of"),
])
def test_invalid_specs_give_one_line_errors(kwargs, message):
    with pytest.raises(PKVError, match=message) as info:
        AttentionSpec(**kwargs)
    assert "\n" not in str(info.value)


def test_dict_roundtrip_and_unknown_fields():
    spec = AttentionSpec(num_qo_heads=16, num_kv_heads=2, head_dim=64, page_size=32, dtype="bfloat16")
    assert AttentionSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(PKVError, match="unknown AttentionSpec field\\(s\\): heads"):
        AttentionSpec.from_dict({"heads": 4})


def test_is_power_of_two():
    assert [n for n in range(-2, 300) if is_power_of_two(n)] == PAGE_SIZES
