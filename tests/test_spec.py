"""AttentionSpec: the valid grid, derived sizes, and one-line errors for every invalid field."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from persistentkv.errors import PKVError
from persistentkv.spec import DTYPE_BYTES, HEAD_DIMS, AttentionSpec, integer_array, is_integer, is_power_of_two

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


def test_numpy_integers_are_stored_as_python_ints():
    """A spec built from NumPy values (a config read with NumPy) serialises like any other."""
    import json

    spec = AttentionSpec(num_qo_heads=np.int64(32), num_kv_heads=np.uint8(8), head_dim=np.int32(128))
    assert spec == AttentionSpec() and all(type(v) in (int, str) for v in spec.to_dict().values())
    assert json.loads(json.dumps(spec.to_dict())) == AttentionSpec().to_dict()


@pytest.mark.parametrize("data", [None, [("dtype", "float16")], "dtype", 7])
def test_from_dict_needs_a_mapping(data):
    with pytest.raises(PKVError, match="an AttentionSpec is read from a mapping of its fields"):
        AttentionSpec.from_dict(data)


@pytest.mark.parametrize("field", ["dtype", "layout"])
@pytest.mark.parametrize("value", [["float16"], {"a": 1}, None, 16])
def test_names_must_be_strings_even_unhashable_ones(field, value):
    with pytest.raises(PKVError, match=f"{field}=.* is not one of"):
        AttentionSpec(**{field: value})


@pytest.mark.parametrize("value, message", [
    ([1, 2**31], r"x\[1\] = 2147483648 is out of range \[0, 2147483647\]"),
    (np.array([2**64 - 1], dtype=np.uint64), r"x\[0\] = 18446744073709551615 is out of range"),
    ([True, False], "x must be integers, got bool values such as True"),
    ([1.0], "x must be integers, got float64 values such as 1.0"),
    ([2**70], "x must be integers, got object values such as 1180591620717411303424"),
    ([[1, 2]], r"x must be a 1-D array of integers, got shape \(1, 2\)"),
    ([[1], [2, 3]], r"x must be a 1-D array of integers, got ragged \[\[1\], \[2, 3\]\]"),
    (7, r"x must be a 1-D array of integers, got shape \(\): 7"),
])
def test_integer_array_refuses_what_a_cast_would_change(value, message):
    with pytest.raises(PKVError, match=message):
        integer_array("x", value, 0, 2**31 - 1)


def test_integer_array_keeps_valid_values_and_their_dtype():
    out = integer_array("x", np.array([0, 2**31 - 1], dtype=np.uint32), 0, 2**31 - 1)
    assert out.dtype == np.uint32 and out.tolist() == [0, 2**31 - 1]
    assert integer_array("x", [], 0, 1).dtype == np.int64           # [] is an empty integer array
    assert is_integer(np.int16(3)) and not is_integer(True) and not is_integer(3.0)
