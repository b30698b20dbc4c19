"""The codec: msgpack and JSON envelopes, tensors as dtype/shape/bytes, never pickle."""

from __future__ import annotations

import pickle

import msgpack
import numpy as np
import orjson
import pytest
import torch

from redbatch import codec
from redbatch.errors import InvalidPayload
from redbatch.protocol import TENSOR_TAG


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
@pytest.mark.parametrize("dtype", sorted(codec.DTYPES))
def test_array_round_trip(fmt: codec.Format, dtype: str) -> None:
    arr = (np.arange(12) % 3).astype(dtype).reshape(3, 4)
    out = codec.decode(codec.encode({"payload": arr}, fmt))["payload"]
    assert out.dtype == np.dtype(dtype)
    assert out.shape == (3, 4)
    np.testing.assert_array_equal(out, arr)


def test_big_endian_and_non_contiguous_arrays_travel_as_little_endian() -> None:
    arr = np.arange(6, dtype=">f4").reshape(2, 3).T
    out = codec.decode(codec.encode({"x": arr}))["x"]
    np.testing.assert_array_equal(out, arr)
    assert out.dtype.byteorder in "<="


def test_torch_tensor_encodes_as_tensor() -> None:
    out = codec.decode(codec.encode({"x": torch.ones(2, 2, dtype=torch.int64)}))["x"]
    np.testing.assert_array_equal(out, np.ones((2, 2), dtype=np.int64))


def test_msgpack_tensor_layout_is_documented_one_key_map() -> None:
    raw = msgpack.unpackb(codec.encode({"x": np.array([1.5], dtype=np.float32)}))
    assert raw["x"] == {TENSOR_TAG: {"dtype": "float32", "shape": [1],
                                     "data": np.float32(1.5).tobytes()}}


def test_json_tensor_data_is_base64() -> None:
    raw = orjson.loads(codec.encode({"x": np.array([1, 2], dtype=np.int32)}, "json"))
    assert raw["x"][TENSOR_TAG]["data"] == "AQAAAAIAAAA="


def test_scalars_and_plain_values_pass_through() -> None:
    msg = {"a": [1, 2.5, "s", None, True], "b": {"c": np.float32(2.0)}}
    assert codec.decode(codec.encode(msg)) == {"a": [1, 2.5, "s", None, True], "b": {"c": 2.0}}


@pytest.mark.parametrize("fields", [
    {"dtype": "object", "shape": [1], "data": b"x"},
    {"dtype": "float32", "shape": [2], "data": b"\x00" * 4},
    {"dtype": "float32", "shape": [-1], "data": b""},
    {"dtype": "float32", "shape": "2", "data": b"\x00" * 8},
    {"dtype": "float32", "shape": [1], "data": "not-bytes"},
    "not a map",
])
def test_hostile_tensors_are_rejected(fields: object) -> None:
    entry = msgpack.packb({"x": {TENSOR_TAG: fields}})
    with pytest.raises(InvalidPayload):
        codec.decode(entry)


def test_pickle_is_never_unpickled(tmp_path: object) -> None:
    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("pwned",))

    with pytest.raises(InvalidPayload):
        codec.decode(pickle.dumps(Boom()))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"{not json", b"\x92\x01"])
def test_garbage_raises_invalid_payload(data: bytes) -> None:
    try:
        value = codec.decode(data)
    except InvalidPayload:
        return
    assert not isinstance(value, dict)  # decodes, but is no envelope: rejected later


def test_oversized_entry_is_rejected() -> None:
    with pytest.raises(InvalidPayload, match="over"):
        codec.decode(b"\x00" * (codec.MAX_ENTRY_BYTES + 1))


def test_unencodable_value_is_invalid_payload() -> None:
    with pytest.raises(InvalidPayload):
        codec.encode({"x": object()})
    with pytest.raises(InvalidPayload):
        codec.encode({"x": np.array(["a"], dtype=object)})


def test_an_entry_of_too_many_lists_and_maps_is_refused_before_it_is_built() -> None:
    """One byte on the wire, about 64 once decoded: a 16 MiB entry of empty lists took
    a worker about 1 GB and seconds of its event loop.  A legal nested list (512 x 512
    x 3, 262,657 lists) still decodes."""
    many = codec.MAX_CONTAINERS + 1
    packed = msgpack.packb({"payload": [[] for _ in range(many)]})
    with pytest.raises(InvalidPayload, match="lists and maps"):
        codec.decode(packed, budget=True)
    text = orjson.dumps({"payload": [{} for _ in range(many)]})
    with pytest.raises(InvalidPayload, match="lists and maps"):
        codec.decode(text, budget=True)
    for data in (packed, text):  # a reply or a pipeline's record: bounded by its size
        assert len(codec.decode(data)["payload"]) == many
    image = np.zeros((512, 512, 3)).tolist()
    for fmt in ("msgpack", "json"):
        assert len(codec.decode(codec.encode({"payload": image}, fmt),
                                budget=True)["payload"]) == 512
