"""Several named inputs and outputs per model (``@batch(inputs=..., outputs=...)``):
the Python client, v1 and v2 over a real Redis and in-process workers; per-field
errors fail only their request; variable-length inputs share one length."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest

from redbatch import BatchPolicy, Model, SyncClient, TensorSpec, batch
from redbatch.demo import pair
from redbatch.errors import ConfigError, InvalidPayload, ModelError
from redbatch.producer import Client
from redbatch.spec import ModelInfo, Signature
from redbatch.worker.forward import Forwarder
from redbatch.worker.process import Worker
from redbatch.worker.torch_helpers import torch_model, torch_named_fn
from tests.conftest import wait_live
from tests.test_gateway import error_code, gateway
from tests.test_metrics import eventually, sample
from tests.test_packing import rows_taken
from tests.test_v2 import v2_error

# a window: requests sent together share a claim (and their passes)
WINDOW = BatchPolicy(max_batch_size=8, batch_wait_timeout_s=0.1)
IDS = TensorSpec("int64", (None,), max_len=16, pad_value=-1)
MASK = TensorSpec("int64", (None,), max_len=16, pad_value=0)
PASSES: list[dict[str, Any]] = []  # what the variable-length model was given


def masked(batch: tuple[dict[str, np.ndarray], np.ndarray]) -> dict[str, Any]:
    """Per-token ``kept = ids * mask`` (trimmed by the worker) and ``count = sum(mask)``;
    records the padded pass (each input padded with its own pad_value)."""
    inputs, lengths = batch
    PASSES.append({"ids": inputs["ids"].copy(), "mask": inputs["mask"].copy(),
                   "lengths": lengths.copy()})
    return {"kept": inputs["ids"] * inputs["mask"], "count": inputs["mask"].sum(axis=1)}


TOKENS = Model("tokens", fn=masked, policy=WINDOW, stack=True, inline=False,
               inputs={"ids": IDS, "mask": MASK},
               outputs={"kept": TensorSpec("int64", (None,)), "count": None})


@batch(name="rows", max_batch_size=8, batch_wait_timeout_s=0.01,
       inputs={"a": TensorSpec("int64", ()), "b": TensorSpec("int64", (2,))},
       outputs=("sum", "product"))
def rows_model(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """stack=False: a list of maps in, a list of maps out."""
    return [{"sum": item["a"] + item["b"], "product": item["a"] * item["b"]}
            for item in items]


@batch(name="forgetful", max_batch_size=8, batch_wait_timeout_s=0.01, stack=True,
       inputs={"a": TensorSpec("float32", ())}, outputs=("x", "y"))
def forgetful(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    return {"x": batch["a"]}  # no "y"


PAIR = Model("pair", fn=pair.fn, policy=WINDOW, stack=True, inputs=pair.inputs,
             outputs=pair.outputs)


def build_masker() -> Any:
    import torch

    class Masker(torch.nn.Module):
        """Keyword inputs (torch tensors) and lengths=; a dict with one key more."""

        def forward(self, ids: Any, mask: Any, lengths: Any) -> dict[str, Any]:
            assert isinstance(ids, torch.Tensor) and lengths.dtype == torch.int64
            return {"kept": ids * mask, "length": lengths, "hidden": ids}  # extra: dropped

    return Masker()


TORCH = torch_model("ttokens", build_masker, policy=WINDOW, inputs={"ids": IDS, "mask": MASK},
                    outputs={"kept": TensorSpec("int64", (None,)), "length": None})


@batch(name="captioned", max_batch_size=8, batch_wait_timeout_s=0.01, stack=True,
       inputs={"image": TensorSpec("float32", (2, 2)), "meta": None}, outputs=("score", "tag"))
def captioned(batch: dict[str, Any]) -> dict[str, Any]:
    """A picture and its metadata (any JSON value: a list of them, unstacked)."""
    meta = batch["meta"]
    assert isinstance(meta, list) and len(meta) == len(batch["image"])
    scales = [m["scale"] if isinstance(m, dict) else float(np.sum(m)) for m in meta]
    return {"score": batch["image"].sum(axis=(1, 2)) * np.asarray(scales, np.float32),
            "tag": [m.get("tag", "").upper() if isinstance(m, dict) else "" for m in meta]}


MODELS = [PAIR, TOKENS, rows_model, forgetful, TORCH, captioned]


@pytest.fixture
async def served(start_worker: Callable[..., Worker], redis_url: str) -> str:
    start_worker(MODELS)
    for model in MODELS:
        await wait_live(redis_url, model.name)
    return redis_url


@pytest.fixture
async def http(served: str) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway(served, max_timeout_s=5.0, default_timeout_s=5.0) as client:
        yield client


def x_row(i: int) -> np.ndarray:
    return np.arange(4, dtype=np.float32) + i


# --- the model contract ------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "says"), [
    ({"spec": TensorSpec(), "inputs": {"a": TensorSpec()}, "outputs": ["y"]},
     "mutually exclusive"),
    ({"inputs": {"a": TensorSpec()}}, "go together"),
    ({"outputs": ["y"]}, "go together"),
    ({"inputs": {}, "outputs": ["y"]}, "at least one input"),
    ({"inputs": {"a b": TensorSpec()}, "outputs": ["y"]}, "'a b'"),
    ({"inputs": {"a": TensorSpec()}, "outputs": "y"}, "not a string"),
    ({"inputs": {"a": "float32"}, "outputs": ["y"]}, "a TensorSpec, or None"),
    ({"inputs": {"a": TensorSpec()}, "outputs": ["y"],
      "output_spec": TensorSpec()}, "mutually exclusive"),
])
def test_bad_named_models_are_refused(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        Model("m", fn=lambda xs: xs, **kwargs)


def test_the_signature_checks_every_field_and_round_trips_through_the_meta() -> None:
    signature = TOKENS.signature
    assert signature is not None and signature.variable == ("ids", "mask")
    assert signature.per_token == ("kept",)
    info = ModelInfo.from_meta(json.loads(json.dumps(TOKENS.meta())))
    assert info.signature is not None and info.spec is None
    assert info.signature.to_json() == signature.to_json()
    assert ModelInfo.from_meta(json.loads(json.dumps(PAIR.meta()))).signature is not None
    assert "inputs" not in Model("one", fn=list, spec=TensorSpec()).meta()  # unchanged
    for payload, says in [
            ({"ids": [1, 2]}, "missing input 'mask'"),
            ({"ids": [1], "mask": [1], "other": 1}, "unknown input 'other'"),
            ({"ids": [1, 2], "mask": [1]}, "input 'mask' has length 1 but 'ids' has 2"),
            ({"ids": [1.5], "mask": [1]}, "input 'ids' must be integers"),
            ({"ids": list(range(17)), "mask": [1] * 17}, "input 'ids' has length 17"),
            ({"ids": [[1]], "mask": [1]}, "input 'ids' shape"),
            ([1, 2], "map of the named inputs")]:
        with pytest.raises(InvalidPayload, match=says):
            signature.check(payload)
    assert Signature.of({"a": TensorSpec()}, ["y"]).outputs == {"y": None}


# --- the Python client ---------------------------------------------------------------------
async def test_two_inputs_over_the_client_and_a_bad_request_fails_alone(served: str) -> None:
    async with Client(served) as client:
        out = await client.predict("pair", {"x": x_row(0), "scale": np.float32(2)})
        np.testing.assert_allclose(out["y"], x_row(0) * 2)
        assert out["norm"] == pytest.approx(float(np.linalg.norm(x_row(0) * 2)), rel=1e-6)
        inputs: list[Any] = [{"x": x_row(i), "scale": 1.0} for i in range(4)]
        inputs[2] = {"x": x_row(2), "scale": 1.0, "extra": 1}  # one bad field
        got = await client.predict_many("pair", inputs, return_exceptions=True)
        assert isinstance(got[2], InvalidPayload) and "'extra'" in str(got[2])
        for i in (0, 1, 3):
            np.testing.assert_allclose(got[i]["y"], x_row(i))
        futures = await client.submit_many("pair", [{"x": [1, 1, 1, 1], "scale": 3}])
        np.testing.assert_allclose((await futures[0])["y"], [3, 3, 3, 3])
        reply = await (await client.submit("pair", {"x": x_row(1), "scale": -1}, reply=True))
        assert reply.ok and reply.timings.batch_size >= 1
        rows = {"x": np.stack([x_row(i) for i in range(3)]), "scale": [1, 0, 2]}
        (whole,) = await client.submit_many("pair", [rows], batched=True)
        assert [float(out["norm"]) for out in await whole] == pytest.approx(
            [float(np.linalg.norm(x_row(0))), 0.0, 2 * float(np.linalg.norm(x_row(2)))])


async def test_maps_of_arrays_travel_packed_and_a_bad_row_fails_alone(served: str) -> None:
    entries = sample("redbatch_batch_entries_sum", model="pair")
    items = sample("redbatch_batch_size_sum", model="pair")
    inputs = [{"x": x_row(i), "scale": np.float32(i)} for i in range(8)]
    inputs[5] = {"x": x_row(5), "scale": np.float32("nan")}
    async with Client(served, pack_rows=32) as client:
        await rows_taken(client, "pair")
        got = await client.predict_many("pair", inputs, return_exceptions=True)
    assert isinstance(got[5], InvalidPayload) and "'scale'" in str(got[5])
    for i in (0, 1, 2, 3, 4, 6, 7):
        np.testing.assert_allclose(got[i]["y"], x_row(i) * i)
    assert await eventually(lambda: sample("redbatch_batch_size_sum", model="pair")
                            == items + 7)
    assert sample("redbatch_batch_entries_sum", model="pair") == entries + 1  # one pack


def _sync_calls(url: str) -> None:
    with SyncClient(url) as client:
        assert client.predict("pair", {"x": [0, 3, 0, 4], "scale": 1})["norm"] == 5.0
        many = client.predict_many("pair", [{"x": x_row(i), "scale": 2} for i in range(3)])
        assert [float(m["y"][0]) for m in many] == [0.0, 2.0, 4.0]
        with pytest.raises(InvalidPayload, match="missing input 'scale'"):
            client.predict("pair", {"x": x_row(0)})


async def test_the_sync_client_takes_and_returns_maps(served: str) -> None:
    await asyncio.to_thread(_sync_calls, served)  # the worker runs on this loop


async def test_stack_false_takes_and_returns_lists_of_maps(served: str) -> None:
    async with Client(served) as client:
        got = await client.predict_many("rows", [{"a": i, "b": [1, 2]} for i in range(5)])
    assert [list(g["sum"]) for g in got] == [[i + 1, i + 2] for i in range(5)]
    assert [list(g["product"]) for g in got] == [[i, 2 * i] for i in range(5)]


async def test_a_broken_return_fails_the_batch_with_a_clear_error(served: str) -> None:
    async with Client(served) as client:
        with pytest.raises(ModelError, match="no output 'y'"):
            await client.predict("forgetful", {"a": 1.0})


def forward(model: Model, items: list[dict[str, Any]]) -> list[Any]:
    """The worker's forward step on checked items, without Redis."""
    assert model.signature is not None and model.fn is not None
    forwarder = Forwarder(model, model.fn, ThreadPoolExecutor(1))
    return asyncio.run(forwarder.run_batches([model.signature.check(i) for i in items]))


@pytest.mark.parametrize(("returned", "says"), [
    ({"x": [1.0]}, "returned 1 values of output 'x' for a batch of 3"),
    ({"x": [1.0] * 3, "z": [0] * 3}, "unknown output 'z'"),
    ({"x": 1.0}, "returned float for output 'x'"),
    ([{"x": 1.0}] * 3, "must return a dict of its outputs"),
])
def test_every_request_of_a_broken_pass_fails_naming_the_output(returned: Any,
                                                                says: str) -> None:
    model = Model("broken", fn=lambda batch: returned, stack=True,
                  inputs={"a": TensorSpec("float32", ())}, outputs=["x"])
    results = forward(model, [{"a": 1.0}] * 3)
    assert all(isinstance(r, ModelError) and says in str(r) for r in results), results


def test_stack_false_gets_each_bucket_apart_unpadded() -> None:
    calls: list[list[int]] = []

    def lengths(items: list[dict[str, np.ndarray]]) -> list[dict[str, Any]]:
        calls.append([len(item["ids"]) for item in items])
        return [{"n": len(item["ids"])} for item in items]

    model = Model("lens", fn=lengths, inputs={"ids": IDS, "mask": MASK}, outputs=["n"])
    got = forward(model, [{"ids": [1] * n, "mask": [1] * n} for n in (5, 1, 7, 2)])
    assert [g["n"] for g in got] == [5, 1, 7, 2]
    assert sorted(calls) == [[1], [2], [5, 7]]  # buckets 1, 2 and 8


# --- variable lengths ------------------------------------------------------------------------
async def test_variable_inputs_share_a_length_bucket_and_are_trimmed(served: str) -> None:
    PASSES.clear()
    lengths = [3, 1, 4, 2]  # buckets 4, 1, 4, 2: each request's own pass length
    inputs = [{"ids": np.arange(1, n + 1, dtype=np.int64) * 10,
               "mask": np.array([1, 0] * n, dtype=np.int64)[:n]} for n in lengths]
    async with Client(served) as client:
        got = await client.predict_many("tokens", inputs)
        with pytest.raises(InvalidPayload, match="'mask' has length 2 but 'ids' has 3"):
            await client.predict("tokens", {"ids": [1, 2, 3], "mask": [1, 1]})
    for item, out in zip(inputs, got, strict=True):
        np.testing.assert_array_equal(out["kept"], item["ids"] * item["mask"])
        assert out["count"] == item["mask"].sum()
    by_length = {p["ids"].shape[1]: p for p in PASSES}
    assert sorted(by_length) == [1, 2, 4]  # one padded pass per bucket
    four = by_length[4]
    assert sorted(four["lengths"].tolist()) == [3, 4]
    short = int(np.argmin(four["lengths"]))
    assert four["ids"][short, 3] == -1 and four["mask"][short, 3] == 0  # own pad values


async def test_a_torch_model_takes_keyword_tensors(served: str) -> None:
    async with Client(served) as client:
        got = await client.predict_many("ttokens", [
            {"ids": [5, 6, 7], "mask": [1, 0, 1]}, {"ids": [9], "mask": [1]}])
    assert got[0]["kept"].tolist() == [5, 0, 7] and got[0]["length"] == 3
    assert got[1]["kept"].tolist() == [9] and got[1]["length"] == 1
    with pytest.raises(ConfigError, match="'lengths'"):
        torch_model("bad", build_masker, inputs={"lengths": IDS}, outputs=["y"])


def test_a_torch_module_may_return_a_tuple_in_outputs_order() -> None:
    fn = torch_named_fn(lambda a, b: (a + b, a * b), "cpu", ["sum", "product"])
    out = fn({"a": np.array([1, 2]), "b": np.array([3, 4])})
    assert {name: value.tolist() for name, value in out.items()} == {
        "sum": [4, 6], "product": [3, 8]}


# --- v1 ----------------------------------------------------------------------------------------
async def test_v1_predict_with_named_inputs_and_outputs(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/models/pair/predict",
                           json={"inputs": {"x": [3, 0, 4, 0], "scale": 2}})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"outputs": {"y": [6.0, 0.0, 8.0, 0.0], "norm": 10.0}}
    assert int(resp.headers["x-redbatch-batch-size"]) >= 1
    resp = await http.get("/v1/models/pair/predict?x=0,3,0,4&scale=1")
    assert resp.status_code == 200 and resp.json()["outputs"]["norm"] == 5.0
    resp = await http.post("/v1/models/tokens/predict",
                           json={"inputs": {"ids": [5, 6, 7], "mask": [1, 1, 0]}})
    assert resp.json() == {"outputs": {"kept": [5, 6, 0], "count": 2}}


@pytest.mark.parametrize(("inputs", "says"), [
    ({"x": [1, 2, 3], "scale": 1}, "input 'x' shape"),
    ({"x": [1, 2, 3, 4]}, "missing input 'scale'"),
    ({"x": [1, 2, 3, 4], "scale": 1, "bias": 0}, "unknown input 'bias'"),
    ({"x": [1, 2, 3, 4], "scale": "big"}, "input 'scale'"),
    ([1, 2, 3, 4], "map of the named inputs"),
])
async def test_v1_bad_fields_are_422_naming_the_field(http: httpx.AsyncClient,
                                                      inputs: Any, says: str) -> None:
    resp = await http.post("/v1/models/pair/predict", json={"inputs": inputs})
    assert resp.status_code == 422 and error_code(resp) == "invalid_payload"
    assert says in resp.json()["error"]["message"]


async def test_v1_models_lists_inputs_and_outputs(http: httpx.AsyncClient) -> None:
    listed = {m["name"]: m for m in (await http.get("/v1/models")).json()["models"]}
    assert listed["pair"]["inputs"] == {"x": {"dtype": "float32", "shape": [4]},
                                        "scale": {"dtype": "float32", "shape": []}}
    assert listed["pair"]["outputs"] == {"y": {"dtype": "float32", "shape": [4]},
                                         "norm": {"dtype": "float32", "shape": []}}
    assert listed["rows"]["outputs"] == {"sum": None, "product": None}


# --- v2 ----------------------------------------------------------------------------------------
def pair_body(rows: int, **extra: Any) -> dict[str, Any]:
    return {"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [rows, 4],
         "data": np.concatenate([x_row(i) for i in range(rows)]).tolist()},
        {"name": "scale", "datatype": "FP32", "shape": [rows], "data": [2.0] * rows}],
        **extra}


async def test_v2_infer_with_two_inputs_and_two_outputs(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v2/models/pair/infer", json=pair_body(3, id="r1"))
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    assert doc["id"] == "r1" and doc["model_name"] == "pair"
    y, norm = doc["outputs"]
    assert (y["name"], y["datatype"], y["shape"]) == ("y", "FP32", [3, 4])
    assert y["data"] == (np.stack([x_row(i) for i in range(3)]) * 2).ravel().tolist()
    assert (norm["name"], norm["datatype"], norm["shape"]) == ("norm", "FP32", [3])
    resp = await http.post("/v2/models/pair/infer",
                           json=pair_body(1, outputs=[{"name": "norm"}]))
    assert [o["name"] for o in resp.json()["outputs"]] == ["norm"]


async def test_v2_named_inputs_take_the_priority_parameter(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v2/models/pair/infer",
                           json=pair_body(2, parameters={"priority": 1}))
    assert resp.status_code == 200, resp.text
    resp = await http.post("/v2/models/pair/infer",
                           json=pair_body(2, parameters={"priority": 2}))  # one level only
    assert resp.status_code == 400 and "parameters.priority" in resp.json()["error"]


async def test_v2_rows_travel_as_multi_row_entries(http: httpx.AsyncClient) -> None:
    entries = sample("redbatch_batch_entries_sum", model="pair")
    items = sample("redbatch_batch_size_sum", model="pair")
    resp = await http.post("/v2/models/pair/infer", json=pair_body(8))
    assert resp.status_code == 200, resp.text
    assert resp.json()["outputs"][0]["shape"] == [8, 4]
    assert await eventually(lambda: sample("redbatch_batch_size_sum", model="pair")
                            == items + 8)
    assert sample("redbatch_batch_entries_sum", model="pair") == entries + 1  # not 8


async def test_v2_binary_inputs_and_outputs(http: httpx.AsyncClient) -> None:
    x = np.stack([x_row(i) for i in range(2)]).astype("<f4").tobytes()
    scale = np.array([1.0, 3.0], dtype="<f4").tobytes()
    head = json.dumps({"inputs": [
        {"name": "scale", "datatype": "FP32", "shape": [2],
         "parameters": {"binary_data_size": len(scale)}},
        {"name": "x", "datatype": "FP32", "shape": [2, 4],
         "parameters": {"binary_data_size": len(x)}}],
        "parameters": {"binary_data_output": True}}).encode()
    resp = await http.post("/v2/models/pair/infer", content=head + scale + x,
                           headers={"Inference-Header-Content-Length": str(len(head))})
    assert resp.status_code == 200, resp.text
    size = int(resp.headers["inference-header-content-length"])
    doc, data = json.loads(resp.content[:size]), resp.content[size:]
    y, norm = doc["outputs"]
    assert y["parameters"]["binary_data_size"] == 32 and len(data) == 32 + 8
    np.testing.assert_allclose(np.frombuffer(data[:32], "<f4").reshape(2, 4),
                               [x_row(0), x_row(1) * 3])
    assert norm["shape"] == [2]


@pytest.mark.parametrize(("change", "says"), [
    (lambda b: b["inputs"].pop(), "missing input 'scale'"),
    (lambda b: b["inputs"].append({**b["inputs"][0], "name": "bias"}), "unknown input 'bias'"),
    (lambda b: b["inputs"].append(b["inputs"][0]), "input 'x' is given 2 times"),
    (lambda b: b["inputs"][1].update(datatype="INT64"), "input 'scale' has datatype FP32"),
    (lambda b: b["inputs"][0].update(shape=[3, 2], data=[0] * 6), "input 'x' shape"),
    (lambda b: b["inputs"][1].update(shape=[2], data=[1, 1]), "input 'scale' has batch "
                                                              "dimension 2 but 'x' has 3"),
    (lambda b: b["inputs"][1].update(data=[1, 1, "a"]), "input 'scale'"),
    (lambda b: b.update(outputs=[{"name": "z"}]), "unknown output 'z'"),
])
async def test_v2_bad_inputs_are_400_naming_the_field(http: httpx.AsyncClient,
                                                      change: Callable[[Any], Any],
                                                      says: str) -> None:
    body = pair_body(3)
    change(body)
    resp = await http.post("/v2/models/pair/infer", json=body)
    assert resp.status_code == 400, resp.text
    assert says in v2_error(resp)


async def test_v2_variable_inputs_share_the_length(http: httpx.AsyncClient) -> None:
    body = {"inputs": [{"name": "ids", "datatype": "INT64", "shape": [2, 3],
                        "data": [1, 2, 3, 4, 5, 6]},
                       {"name": "mask", "datatype": "INT64", "shape": [2, 3],
                        "data": [1, 1, 0, 1, 0, 1]}]}
    resp = await http.post("/v2/models/tokens/infer", json=body)
    assert resp.status_code == 200, resp.text
    kept, count = resp.json()["outputs"]
    assert kept["shape"] == [2, 3] and kept["data"] == [1, 2, 0, 4, 0, 6]
    assert count["data"] == [2, 2]
    body["inputs"][1].update(shape=[2, 2], data=[1, 1, 1, 1])
    resp = await http.post("/v2/models/tokens/infer", json=body)
    assert resp.status_code == 400 and "'mask' has length 2 but 'ids' has 3" in v2_error(resp)


async def test_v2_metadata_and_config_list_every_input_and_output(
        http: httpx.AsyncClient) -> None:
    meta = (await http.get("/v2/models/pair")).json()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]},
                              {"name": "scale", "datatype": "FP32", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 4]},
                               {"name": "norm", "datatype": "FP32", "shape": [-1]}]
    config = (await http.get("/v2/models/pair/config")).json()
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
        ("x", "TYPE_FP32", [4]), ("scale", "TYPE_FP32", [])]
    assert [o["name"] for o in config["output"]] == ["y", "norm"]
    rows = (await http.get("/v2/models/rows")).json()
    assert rows["outputs"][0] == {"name": "sum", "datatype": "ANY", "shape": [-1, -1]}


async def test_v2_one_bad_row_fails_the_call_naming_the_row(http: httpx.AsyncClient) -> None:
    body = {"inputs": [{"name": "a", "datatype": "INT64", "shape": [2], "data": [1, 2]},
                       {"name": "b", "datatype": "INT64", "shape": [2, 2],
                        "data": [1, 2, 3, 4]}]}
    resp = await http.post("/v2/models/rows/infer", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["outputs"][0]["data"] == [2, 3, 5, 6]
    resp = await http.post("/v2/models/forgetful/infer", json={"inputs": [
        {"name": "a", "datatype": "FP32", "shape": [2], "data": [1, 2]}]})
    assert resp.status_code == 500 and "row 0 of 2" in v2_error(resp)
    assert "no output 'y'" in v2_error(resp)


def test_the_demo_pair_model() -> None:
    assert pair.signature is not None and pair.fn is not None
    out = pair.fn({"x": np.ones((2, 4), np.float32), "scale": np.array([1, 2], np.float32)})
    np.testing.assert_allclose(out["norm"], [2.0, 4.0])


def test_pad_to_longest_pads_every_named_input_to_the_pass_longest() -> None:
    """Lengths 5, 7 and 6 share bucket 8: one pass padded to 7, each input with its own
    pad value; the per-token output comes back trimmed to each request's length."""
    PASSES.clear()
    model = Model("tokens7", fn=masked, policy=BatchPolicy(pad_to_longest=True), stack=True,
                  inputs={"ids": IDS, "mask": MASK},
                  outputs={"kept": TensorSpec("int64", (None,)), "count": None})
    items = [{"ids": list(range(1, n + 1)), "mask": [1] * n} for n in (5, 7, 6)]
    got = forward(model, items)
    assert [len(g["kept"]) for g in got] == [5, 7, 6]
    (only,) = PASSES
    assert only["ids"].shape == only["mask"].shape == (3, 7)
    assert only["lengths"].tolist() == [5, 6, 7]  # sorted by length
    assert only["ids"][0, 5:].tolist() == [-1, -1] and only["mask"][0, 5:].tolist() == [0, 0]


# --- an input of any value (its spec None) ----------------------------------------------
async def test_an_input_without_a_spec_takes_any_value(http: httpx.AsyncClient,
                                                       served: str) -> None:
    """An image and its metadata: the metadata (a JSON map) is neither checked nor
    stacked; the function gets the list of them, in the batch's order."""
    async with Client(served) as client:
        outs = await asyncio.gather(*(client.predict("captioned", {
            "image": np.full((2, 2), i, np.float32), "meta": {"scale": 2, "tag": f"t{i}"}})
            for i in range(3)))
    assert [o["tag"] for o in outs] == ["T0", "T1", "T2"]
    assert [float(o["score"]) for o in outs] == [0.0, 8.0, 16.0]
    resp = await http.post("/v1/models/captioned/predict", json={"inputs": {
        "image": [[1, 2], [3, 4]], "meta": {"scale": 3, "tag": "dog"}}})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"outputs": {"score": 30.0, "tag": "DOG"}}
    tagged = await http.post("/v1/models/captioned/predict", json={"inputs": {
        "image": [[1, 2], [3, 4]], "meta": {"__tensor__": "AAAA"}}})
    assert tagged.status_code == 422 and "spells a tensor" in tagged.json()["error"]["message"]
    bad = await http.post("/v1/models/captioned/predict",
                          json={"inputs": {"image": [1, 2], "meta": {}}})
    assert bad.status_code == 422 and "input 'image' shape" in bad.json()["error"]["message"]
    info = ModelInfo.from_meta(json.loads(json.dumps(captioned.meta())))
    assert info.signature is not None and info.signature.inputs["meta"] is None
    meta = (await http.get("/v2/models/captioned")).json()
    assert {"name": "meta", "datatype": "ANY", "shape": [-1, -1]} in meta["inputs"]
    v2 = await http.post("/v2/models/captioned/infer", json={"inputs": [
        {"name": "image", "datatype": "FP32", "shape": [1, 2, 2], "data": [1, 1, 1, 1]},
        {"name": "meta", "datatype": "INT64", "shape": [1, 2], "data": [2, 3]}],
        "outputs": [{"name": "score"}]})  # (a string output has no v2 datatype)
    assert v2.status_code == 200, v2.text
    outputs = {o["name"]: o for o in v2.json()["outputs"]}
    assert outputs["score"]["data"] == [20.0]
