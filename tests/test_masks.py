"""Inputs a caller padded itself: a variable-length spec with ``mask`` takes the mask
field beside its input (v1 body, GET query, v2 second input), and the gateway cuts the
input to the positions the mask marks, so the model sees it as if it came unpadded;
``redbatch.unpad`` does the same for Python callers.  A mask that is not one run of 1s
as long as the input is refused, naming the field."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import orjson
import pytest

from redbatch import TensorSpec, unpad
from redbatch.demo import TOKENS, echo_tokens
from redbatch.errors import ConfigError, InvalidPayload
from redbatch.spec import real_span
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from tests.conftest import wait_live
from tests.test_gateway import error_code, gateway
from tests.test_v2 import v2_error

POLICY = BatchPolicy(max_batch_size=8, batch_wait_timeout_s=0.005)
MASKED = replace(TOKENS, mask="attention_mask")


def sums(batch: Any) -> list[list[int]]:
    """Pooled: each request's sum of token ids and the length the model was given."""
    padded, lengths = batch
    return [[int(row.sum()), int(n)] for row, n in zip(padded, lengths, strict=True)]


def masked_models() -> list[Model]:
    tokens = replace(echo_tokens(POLICY), name="mtoks", spec=MASKED)
    pooled = Model("msum", fn=sums, policy=POLICY, spec=MASKED, input_name="input_ids",
                   stack=True, inline=True)
    return [tokens, pooled]


# --- the spec -------------------------------------------------------------------------
@pytest.mark.parametrize(("mask", "span"), [
    ([1, 1, 1], (0, 3)), ([1, 1, 0, 0], (0, 2)), ([0, 0, 1, 1], (2, 4)),
    ([0, 1, 1, 0], (1, 3)), ([True, False], (0, 1)), (np.array([0, 1], np.int8), (1, 2))])
def test_the_real_span_is_the_run_of_ones(mask: Any, span: tuple[int, int]) -> None:
    assert real_span(mask, len(mask)) == span


@pytest.mark.parametrize(("mask", "says"), [
    ([1, 0, 1], "padding between real positions"),
    ([0, 0, 0], "marks no real position"),
    ([1, 1], "has shape (2,)"),
    ([[1, 1, 1]], "has shape (1, 3)"),
    ([1, 2, 1], "only the integers 0"),
    ([1.0, 1.0, 0.0], "only the integers 0"),
    ([1, "a", 1], "only the integers 0"),
])
def test_a_mask_that_is_not_one_run_of_ones_is_refused(mask: Any, says: str) -> None:
    with pytest.raises(InvalidPayload, match="attention_mask") as caught:
        real_span(mask, 3, "attention_mask")
    assert says in str(caught.value)


def test_unpad_cuts_an_input_and_its_rows_to_the_mask() -> None:
    assert unpad([0, 7, 8, 0], [0, 1, 1, 0]).tolist() == [7, 8]
    rows = np.arange(8).reshape(4, 2)  # a spec of shape (None, 2): the mask is per row
    assert unpad(rows, [1, 1, 1, 0]).tolist() == rows[:3].tolist()
    with pytest.raises(InvalidPayload, match="padding between"):
        unpad([1, 2, 3], [1, 0, 1])


def test_check_masked_counts_the_real_length_against_max_len() -> None:
    spec = TensorSpec("int64", (None,), max_len=4, mask="attention_mask")
    assert spec.check_masked([0] * 6 + [1, 2], [0] * 6 + [1, 1]).tolist() == [1, 2]
    with pytest.raises(InvalidPayload, match="length 5"):
        spec.check_masked([1] * 6, [1] * 5 + [0])
    with pytest.raises(InvalidPayload, match="input must be integers"):
        spec.check_masked([0.5, 1.0], [1, 1])


def test_an_empty_input_is_named_as_such_not_as_floats() -> None:
    """``[]`` reads as a float array: it was refused as "must be integers"."""
    with pytest.raises(InvalidPayload, match="length 0"):
        TensorSpec("int64", (None,), max_len=4).check([])
    with pytest.raises(InvalidPayload, match=r"shape \(0,\) does not match"):
        TensorSpec("int64", (4,)).check([])


def test_a_mask_needs_a_variable_length_and_a_field_name() -> None:
    with pytest.raises(ConfigError, match="variable length"):
        TensorSpec("int64", (3,), mask="attention_mask")
    with pytest.raises(ConfigError, match="must match"):
        TensorSpec("int64", (None,), max_len=8, mask="not a name")
    assert TensorSpec.from_json(MASKED.to_json()).mask == "attention_mask"
    assert MASKED.to_json()["mask"] == "attention_mask"
    assert "mask" not in TOKENS.to_json()


# --- the gateway ----------------------------------------------------------------------
async def test_v1_cuts_a_padded_input_to_its_mask(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker(masked_models())
    async with gateway(redis_url) as http:
        await wait_live(redis_url, "mtoks")
        for ids, mask in [([5, 6, 7], None), ([5, 6, 7, 0, 0], [1, 1, 1, 0, 0]),
                          ([0, 0, 5, 6, 7], [0, 0, 1, 1, 1]), ([0, 5, 6, 7, 0], [0, 1, 1, 1, 0])]:
            body: dict[str, Any] = {"x": ids} if mask is None else {
                "x": ids, "attention_mask": mask}
            resp = await http.post("/v1/models/mtoks/predict", json=body)
            assert resp.status_code == 200 and resp.json()["y"] == [5, 6, 7], (body, resp.text)
        long = await http.post("/v1/models/mtoks/predict",  # padded past max_len: fine
                               json={"x": [9, 8] + [0] * 600, "attention_mask": [1, 1] + [0] * 600})
        assert long.status_code == 200 and long.json()["y"] == [9, 8]
        got = await http.get("/v1/models/mtoks/predict?x=0,5,6&attention_mask=0,1,1")
        assert got.status_code == 200 and got.json()["y"] == [5, 6], got.text


@pytest.mark.parametrize(("ids", "mask", "says"), [
    ([5, 6, 7], [1, 0, 1], "attention_mask has padding between real positions"),
    ([5, 6, 7], [1, 1], "attention_mask has shape (2,)"),
    ([5, 6, 7], [0, 0, 0], "attention_mask marks no real position"),
    ([5, 6, 7], [1, 1, 2], "attention_mask must hold only the integers 0"),
    ([1] * 600, [1] * 513 + [0] * 87, "x has length 513"),
])
async def test_v1_refuses_a_bad_mask_with_422_naming_it(
        start_worker: Callable[..., Worker], redis_url: str, ids: list[int],
        mask: list[int], says: str) -> None:
    start_worker(masked_models())
    async with gateway(redis_url) as http:
        await wait_live(redis_url, "mtoks")
        resp = await http.post("/v1/models/mtoks/predict",
                               json={"x": ids, "attention_mask": mask})
    assert resp.status_code == 422 and error_code(resp) == "invalid_payload"
    assert says in resp.json()["error"]["message"], resp.text


def masked_call(ids: list[list[int]], mask: list[list[int]], *, mask_first: bool = False,
                binary: bool = False, name: str = "input_ids") -> tuple[bytes, dict[str, str]]:
    """A v2 infer call of ``ids`` and their ``mask`` (JSON, or binary data)."""
    shape = [len(ids), len(ids[0])]
    tensors = []
    for tname, rows in ((name, ids), ("attention_mask", mask)):
        flat = [v for row in rows for v in row]
        tensor: dict[str, Any] = {"name": tname, "datatype": "INT64", "shape": shape}
        if binary:
            chunk = struct.pack(f"<{len(flat)}q", *flat)
            tensor["parameters"] = {"binary_data_size": len(chunk)}
            tensors.append((tensor, chunk))
        else:
            tensor["data"] = flat
            tensors.append((tensor, b""))
    if mask_first:
        tensors.reverse()
    raw = b"".join(chunk for _, chunk in tensors)
    header = orjson.dumps({"inputs": [t for t, _ in tensors]})
    headers = {"content-type": "application/octet-stream",
               "inference-header-content-length": str(len(header))} if binary else {
        "content-type": "application/json"}
    return header + raw, headers


@pytest.mark.parametrize(("mask_first", "binary"), [(False, False), (True, True), (False, True)])
async def test_v2_takes_the_mask_as_a_second_input_row_by_row(
        start_worker: Callable[..., Worker], redis_url: str, mask_first: bool,
        binary: bool) -> None:
    """Rows of different real lengths (2, 3, 1, 2): each served at its own length, the
    replies in the call's row order."""
    start_worker(masked_models())
    ids = [[1, 2, 0, 0], [0, 3, 4, 5], [6, 0, 0, 0], [0, 0, 7, 8]]
    mask = [[1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 1, 1]]
    content, headers = masked_call(ids, mask, mask_first=mask_first, binary=binary)
    async with gateway(redis_url) as http:
        await wait_live(redis_url, "msum")
        resp = await http.post("/v2/models/msum/infer", content=content, headers=headers)
        assert resp.status_code == 200, resp.text
        (out,) = resp.json()["outputs"]
        assert out["shape"] == [4, 2]
        assert out["data"] == [3, 2, 12, 3, 6, 1, 15, 2]
        config = (await http.get("/v2/models/msum/config")).json()
        assert config["input"][1] == {"name": "attention_mask", "data_type": "TYPE_INT64",
                                      "dims": [-1], "optional": True}


async def test_v2_refuses_a_bad_mask_with_400(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker(masked_models())
    async with gateway(redis_url) as http:
        await wait_live(redis_url, "msum")
        await wait_live(redis_url, "mtoks")
        content, headers = masked_call([[1, 2, 3], [4, 5, 6]], [[1, 1, 1], [1, 0, 1]])
        hole = await http.post("/v2/models/msum/infer", content=content, headers=headers)
        assert hole.status_code == 400
        assert "row 1: input 'attention_mask' has padding" in v2_error(hole)
        body = {"inputs": [
            {"name": "input_ids", "datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]},
            {"name": "attention_mask", "datatype": "INT64", "shape": [1, 2], "data": [1, 1]}]}
        shape = await http.post("/v2/models/msum/infer", json=body)
        assert shape.status_code == 400 and "must have the input's batch and length" in \
            v2_error(shape)
        body["inputs"][1] = {"name": "attention_mask", "datatype": "FP32", "shape": [1, 3],
                             "data": [1.0, 1.0, 1.0]}
        fp = await http.post("/v2/models/msum/infer", json=body)
        assert fp.status_code == 400 and "is a mask" in v2_error(fp)
        body["inputs"][1] = dict(body["inputs"][0])
        twice = await http.post("/v2/models/msum/infer", json=body)
        assert twice.status_code == 400 and "given 2 times" in v2_error(twice)
        only_mask = {"inputs": [{"name": "attention_mask", "datatype": "INT64",
                                 "shape": [1, 1], "data": [1]}]}
        missing = await http.post("/v2/models/msum/infer", json=only_mask)
        assert missing.status_code == 400 and "missing input 'input_ids'" in v2_error(missing)
        content, headers = masked_call([[1, 2, 0], [4, 5, 6]], [[1, 1, 0], [1, 1, 1]],
                                       name="x")
        ragged = await http.post("/v2/models/mtoks/infer", content=content, headers=headers)
        assert ragged.status_code == 400 and "rows of one real length" in v2_error(ragged)
        content, headers = masked_call([[0, 1, 2], [4, 5, 0]], [[0, 1, 1], [1, 1, 0]],
                                       name="x")
        same = await http.post("/v2/models/mtoks/infer", content=content, headers=headers)
        assert same.status_code == 200, same.text
        assert same.json()["outputs"][0]["data"] == [1, 2, 4, 5]


def test_a_mask_goes_beside_a_models_one_input() -> None:
    with pytest.raises(ConfigError, match="cannot be the input field 'x'"):
        Model("m", fn=list, spec=replace(TOKENS, mask="x"), input_name="x")
    with pytest.raises(ConfigError, match="takes its mask as an input of its own"):
        Model("m", fn=list, inputs={"ids": MASKED}, outputs=["y"])


def counted_tokens(calls: list[int]) -> Model:
    """Per-token, as ``echo_tokens``, counting its passes."""
    def echo(batch: Any) -> Any:
        calls.append(len(batch[0]))
        return batch[0]
    return replace(echo_tokens(POLICY), name="ctoks", fn=echo, spec=MASKED)


async def test_v2_refuses_ragged_rows_of_a_per_token_model_before_computing_them(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """The model publishes its per-token output spec, so rows of several real lengths
    are refused at the gateway: nothing reaches the model.  Its v2 metadata and config
    list that output."""
    calls: list[int] = []
    start_worker([counted_tokens(calls)])
    async with gateway(redis_url) as http:
        await wait_live(redis_url, "ctoks")
        content, headers = masked_call([[1, 2, 0], [4, 5, 6]], [[1, 1, 0], [1, 1, 1]],
                                       name="x")
        ragged = await http.post("/v2/models/ctoks/infer", content=content, headers=headers)
        assert ragged.status_code == 400 and "rows of one real length" in v2_error(ragged)
        assert calls == []
        content, headers = masked_call([[1, 2, 0], [4, 5, 0]], [[1, 1, 0], [1, 1, 0]],
                                       name="x")
        same = await http.post("/v2/models/ctoks/infer", content=content, headers=headers)
        assert same.status_code == 200, same.text
        assert same.json()["outputs"][0]["data"] == [1, 2, 4, 5] and calls
        meta = (await http.get("/v2/models/ctoks")).json()
        assert meta["outputs"] == [{"name": "y", "datatype": "INT64", "shape": [-1, -1]}]
        config = (await http.get("/v2/models/ctoks/config")).json()
        assert config["output"] == [{"name": "y", "data_type": "TYPE_INT64", "dims": [-1]}]


def test_a_pipeline_of_masked_input_and_per_token_named_outputs_is_refused_before_compute(
        ) -> None:
    """Rows cut to several real lengths cannot share one output tensor: refused before
    any compute whether the per-token output is the one output or a named one (a
    pipeline's last stage's), not a 500 after it."""
    from redbatch.api import v2_masked
    from redbatch.errors import BadRequest
    from redbatch.spec import ModelInfo

    spec = TensorSpec("int64", (None,), max_len=4, mask="attention_mask")
    meta = {"name": "p", "spec": spec.to_json(),
            "outputs": {"tok": TensorSpec("float32", (None,)).to_json(), "n": None}}
    info = ModelInfo.from_meta(meta)
    assert info.per_token
    arr, mask = np.ones((2, 4), dtype=np.int64), np.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    with pytest.raises(BadRequest, match=re.escape(v2_masked.RAGGED_OUTPUTS)):
        v2_masked.runs(arr, mask, info)
