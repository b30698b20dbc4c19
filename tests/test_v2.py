"""KServe v2 / Open Inference Protocol on the gateway (``redbatch/api/v2.py``).

A real Redis, real (in-process) workers, and the gateway under a real uvicorn on a
TCP port, so that the real ``tritonclient.http`` client can drive it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import jsonschema
import numpy as np
import pytest
import tritonclient.http as triton
import uvicorn
from starlette.routing import Route
from tritonclient.utils import InferenceServerException

from redbatch import BatchPolicy, GatewayConfig, Model, RedisSettings, TensorSpec, batch
from redbatch.api import create_app
from redbatch.api.openapi import openapi_document
from redbatch.demo import pair
from redbatch.embedded import free_port
from redbatch.worker.process import Worker
from tests.test_gateway import gateway
from tests.test_metrics import eventually, sample

WINDOW = BatchPolicy(max_batch_size=16, batch_wait_timeout_s=0.02)


def double_rows(xs: list[np.ndarray]) -> list[np.ndarray]:
    return [x * 2 for x in xs]


def inc_rows(xs: list[np.ndarray]) -> list[np.ndarray]:
    return [x + 1 for x in xs]


DOUBLE = Model("double", fn=double_rows, spec=TensorSpec("float32", (4,)), input_name="x",
               output_name="y", policy=WINDOW)
NOT = Model("not", fn=lambda xs: [~x for x in xs], spec=TensorSpec("bool", (2,)),
            input_name="x", output_name="y", policy=WINDOW)
INC = Model("inc", fn=inc_rows, spec=TensorSpec("int64", (None,)), input_name="ids",
            output_name="next", policy=WINDOW)


@batch(name="plus", batch_wait_timeout_s=0)
def plus(ns: list[int]) -> list[int]:  # no TensorSpec, like the demo's adder
    return [n + 1 for n in ns]


@batch(name="picky", batch_wait_timeout_s=0)
def picky(ns: list[int]) -> list[int]:
    if any(n < 0 for n in ns):
        raise ValueError("negative input")
    return ns


def _sleep_rows(xs: list[np.ndarray]) -> list[np.ndarray]:
    time.sleep(1.0)
    return xs


SLEEPY = Model("sleepy", fn=_sleep_rows, spec=TensorSpec("float32", (1,)), input_name="x",
               inline=False, policy=BatchPolicy(batch_wait_timeout_s=0))
MODELS = [DOUBLE, INC, NOT, plus, picky, SLEEPY, pair]
CONFIG = GatewayConfig(max_timeout_s=5.0, default_timeout_s=5.0, max_body_bytes=64 * 1024)


@pytest.fixture
async def server(start_worker: Callable[..., Worker], redis_url: str) -> AsyncIterator[str]:
    """``host:port`` of a real uvicorn serving the gateway (in a thread, own loop)."""
    start_worker(MODELS)
    port = free_port()
    app = create_app(CONFIG, RedisSettings(redis_url))
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, ws="none",
                                       log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        last: Any = None
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            for _ in range(200):
                try:
                    last = await http.get("/v2/health/ready")
                    if last.status_code == 200:
                        break
                except httpx.TransportError as exc:
                    last = exc
                await asyncio.sleep(0.05)
            else:
                pytest.fail(f"gateway never ready (last: {last})")
        yield f"127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        await asyncio.to_thread(thread.join, 10)


@pytest.fixture
async def http(server: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://{server}", timeout=10) as client:
        yield client


def infer_body(name: str, datatype: str, shape: list[int], data: Any, **extra: Any
               ) -> dict[str, Any]:
    return {"inputs": [{"name": name, "datatype": datatype, "shape": shape, "data": data}],
            **extra}


def v2_error(resp: httpx.Response) -> str:
    body = resp.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    assert "Traceback" not in resp.text
    return str(body["error"])


# --- the real tritonclient over TCP ------------------------------------------------------
def _triton_session(url: str) -> dict[str, Any]:
    """Everything a Triton user would do first, with the real client (blocking)."""
    client = triton.InferenceServerClient(url=url)
    try:
        seen: dict[str, Any] = {"live": client.is_server_live(),
                                "ready": client.is_server_ready(),
                                "model_ready": client.is_model_ready("double"),
                                "metadata": client.get_model_metadata("double")}
        x = np.arange(20, dtype=np.float32).reshape(5, 4) / 4
        fp32 = triton.InferInput("x", [5, 4], "FP32")
        fp32.set_data_from_numpy(x)  # binary data extension, binary output by default
        seen["fp32"] = (x, client.infer("double", [fp32], request_id="req-7"))
        ids = np.array([[1, 2, 3], [-5, 0, 2**40]], dtype=np.int64)
        int64 = triton.InferInput("ids", [2, 3], "INT64")
        int64.set_data_from_numpy(ids, binary_data=False)  # JSON in and out
        out = triton.InferRequestedOutput("next", binary_data=False)
        seen["int64"] = (ids, client.infer("inc", [int64], outputs=[out]))
        flags = np.array([[True, False], [False, False], [True, True]])
        boolean = triton.InferInput("x", [3, 2], "BOOL")
        boolean.set_data_from_numpy(flags)
        seen["bool"] = (flags, client.infer("not", [boolean]))
        try:
            client.infer("nope", [fp32])
        except InferenceServerException as exc:
            seen["unknown"] = exc
        return seen
    finally:
        client.close()


async def test_tritonclient_infer_fp32_and_int64(server: str) -> None:
    seen = await asyncio.to_thread(_triton_session, server)
    assert seen["live"] and seen["ready"] and seen["model_ready"]
    assert seen["metadata"] == {
        "name": "double", "versions": ["1"], "platform": "redbatch",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}]}
    x, result = seen["fp32"]
    y = result.as_numpy("y")
    assert y.dtype == np.float32 and y.shape == (5, 4)
    np.testing.assert_array_equal(y, x * 2)
    assert result.get_response()["id"] == "req-7"
    assert result.get_output("y")["parameters"]["binary_data_size"] == 80
    ids, result = seen["int64"]
    nxt = result.as_numpy("next")
    assert nxt.dtype == np.int64 and nxt.tolist() == (ids + 1).tolist()
    assert result.get_output("next")["datatype"] == "INT64"
    assert "data" in result.get_output("next")  # JSON, as asked
    flags, result = seen["bool"]
    assert result.as_numpy("y").tolist() == (~flags).tolist()
    assert seen["unknown"].status() == "404" and "nope" in seen["unknown"].message()


def _triton_pair(url: str) -> tuple[Any, Any]:
    """A model with two named inputs and two named outputs, from the real client:
    both inputs as binary data (in one body), one output binary, one JSON."""
    client = triton.InferenceServerClient(url=url)
    try:
        x = triton.InferInput("x", [3, 4], "FP32")
        x.set_data_from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4))
        scale = triton.InferInput("scale", [3], "FP32")
        scale.set_data_from_numpy(np.array([1, 2, 3], dtype=np.float32))
        outputs = [triton.InferRequestedOutput("norm", binary_data=False),
                   triton.InferRequestedOutput("y")]
        return client.get_model_metadata("pair"), client.infer("pair", [scale, x],
                                                               outputs=outputs)
    finally:
        client.close()


async def test_tritonclient_two_inputs_and_two_outputs(server: str) -> None:
    metadata, result = await asyncio.to_thread(_triton_pair, server)
    assert [i["name"] for i in metadata["inputs"]] == ["x", "scale"]
    assert [o["name"] for o in metadata["outputs"]] == ["y", "norm"]
    want = np.arange(12, dtype=np.float32).reshape(3, 4) * np.array([[1], [2], [3]])
    np.testing.assert_allclose(result.as_numpy("y"), want)
    np.testing.assert_allclose(result.as_numpy("norm"), np.linalg.norm(want, axis=1),
                               rtol=1e-6)
    assert [o["name"] for o in result.get_response()["outputs"]] == ["norm", "y"]
    assert "data" in result.get_output("norm")


def _triton_repository(url: str) -> dict[str, Any]:
    """The repository and statistics extensions, and errors, with the real client."""
    client = triton.InferenceServerClient(url=url)
    try:
        x = triton.InferInput("x", [3, 4], "FP32")
        x.set_data_from_numpy(np.ones((3, 4), dtype=np.float32))
        client.infer("double", [x])
        seen: dict[str, Any] = {"index": client.get_model_repository_index()}
        for _ in range(100):  # the counters travel with the workers' heartbeats
            seen["stats"] = client.get_inference_statistics("double")
            if seen["stats"]["model_stats"][0]["inference_count"] >= 3:
                break
            time.sleep(0.1)
        seen["all"] = client.get_inference_statistics()
        seen["v1"] = client.get_inference_statistics("double", "1")
        for case, call in [("no model", lambda: client.get_inference_statistics("nope")),
                           ("no route", lambda: client.unload_model("double")),
                           ("no version", lambda: client.get_model_metadata("double", "7"))]:
            try:
                call()
            except InferenceServerException as exc:
                seen[case] = exc
        return seen
    finally:
        client.close()


async def test_tritonclient_repository_index_statistics_and_errors(server: str) -> None:
    seen = await asyncio.to_thread(_triton_repository, server)
    index = {entry["name"]: entry for entry in seen["index"]}
    assert set(index) == {m.name for m in MODELS}
    assert index["double"] == {"name": "double", "version": "1", "state": "READY",
                               "reason": ""}
    stats = seen["stats"]["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("double", "1")]
    assert stats[0]["inference_count"] >= 3 and stats[0]["execution_count"] >= 1
    inference = stats[0]["inference_stats"]
    assert inference["success"]["count"] >= 1 and inference["fail"] == {"count": 0, "ns": 0}
    assert inference["compute_infer"]["count"] >= 1 and inference["compute_infer"]["ns"] > 0
    counts = {inference[k]["count"] for k in ("success", "queue", "compute_input",
                                               "compute_infer", "compute_output")}
    assert len(counts) == 1  # perf_analyzer refuses statistics whose compute counts differ
    assert {s["name"] for s in seen["all"]["model_stats"]} == {m.name for m in MODELS}
    assert seen["v1"]["model_stats"][0]["name"] == "double"
    for case, status, needle in [("no model", "404", "nope"), ("no route", "404", "Not Found"),
                                 ("no version", "404", "version")]:
        exc = seen[case]
        assert exc.status() == status and needle in exc.message(), (case, str(exc))
        assert isinstance(exc.message(), str) and needle in str(exc)


async def test_every_v2_error_has_the_v2_shape(http: httpx.AsyncClient) -> None:
    for method, path, status in [("GET", "/v2/nothing/here", 404),
                                 ("POST", "/v2/repository/models/double/load", 404),
                                 ("DELETE", "/v2/models/double", 405),
                                 ("GET", "/v2/models/double/infer", 405)]:
        resp = await http.request(method, path)
        assert resp.status_code == status, (path, resp.text)
        v2_error(resp)
    v1 = await http.get("/v1/nothing")
    assert v1.status_code == 404 and v1.json()["error"]["code"] == "http_error"
    resp = await http.post("/v2/repository/index", json={"ready": "yes"})
    assert resp.status_code == 400 and "ready" in v2_error(resp)
    resp = await http.post("/v2/repository/index", json={"ready": True})
    assert {e["state"] for e in resp.json()} == {"READY"}


# --- plain HTTP -----------------------------------------------------------------------
async def test_json_infer_echoes_id_and_batches_rows_together(http: httpx.AsyncClient) -> None:
    rows = [[i, i + 0.5, -i, 0.25] for i in range(5)]
    resp = await http.post("/v2/models/double/infer", json=infer_body(
        "x", "FP32", [5, 4], [v for row in rows for v in row], id="abc-1"))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"] == "abc-1" and body["model_name"] == "double"
    assert body["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [5, 4],
                                "data": [2 * v for row in rows for v in row]}]
    assert resp.headers["x-redbatch-batch-size"] == "5"  # one enqueue, one forward pass
    resp = await http.post("/v2/models/double/infer",
                           json=infer_body("x", "FP32", [2, 4], [rows[1], rows[2]]))
    assert resp.json()["outputs"][0]["data"][:4] == [2 * v for v in rows[1]]  # nested data
    assert "id" not in resp.json()


async def test_model_without_a_spec_takes_scalar_rows(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v2/models/plus/infer",
                           json=infer_body("inputs", "INT64", [3], [41, 0, -2]))
    assert resp.status_code == 200, resp.text
    assert resp.json()["outputs"] == [{"name": "outputs", "datatype": "INT64", "shape": [3],
                                       "data": [42, 1, -1]}]
    meta = (await http.get("/v2/models/plus")).json()
    assert meta["inputs"] == [{"name": "inputs", "datatype": "ANY", "shape": [-1]}]


async def test_a_tensor_travels_as_multi_row_entries_never_split(
        http: httpx.AsyncClient) -> None:
    entries = sample("redbatch_batch_entries_sum", model="plus")
    items = sample("redbatch_batch_size_sum", model="plus")
    resp = await http.post("/v2/models/plus/infer",
                           json=infer_body("inputs", "INT64", [8], list(range(8))))
    assert resp.status_code == 200, resp.text
    assert resp.json()["outputs"][0]["data"] == list(range(1, 9))
    assert await eventually(lambda: sample("redbatch_batch_size_sum", model="plus")
                            == items + 8)
    assert sample("redbatch_batch_entries_sum", model="plus") == entries + 1  # not 8


async def test_raw_binary_request(http: httpx.AsyncClient) -> None:
    x = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=np.float32)
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4],
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}
                      ).encode()
    resp = await http.post("/v2/models/double/infer", content=head + x.tobytes(),
                           headers={"Inference-Header-Content-Length": str(len(head))})
    assert resp.status_code == 200, resp.text
    size = int(resp.headers["inference-header-content-length"])
    meta = json.loads(resp.content[:size])
    assert meta["outputs"][0]["parameters"] == {"binary_data_size": 32}
    out = np.frombuffer(resp.content[size:], dtype="<f4").reshape(2, 4)
    np.testing.assert_array_equal(out, x * 2)


async def test_health_metadata_config_and_versions(http: httpx.AsyncClient) -> None:
    assert (await http.get("/v2/health/live")).status_code == 200
    assert (await http.get("/v2/health/ready")).status_code == 200
    server = (await http.get("/v2")).json()
    assert server["name"] == "redbatch" and "binary_tensor_data" in server["extensions"]
    meta = (await http.get("/v2/models/inc/versions/1")).json()
    assert meta["inputs"] == [{"name": "ids", "datatype": "INT64", "shape": [-1, -1]}]
    config = (await http.get("/v2/models/double/config")).json()
    assert config["max_batch_size"] == 16
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}]
    assert (await http.get("/v2/models/double/versions/1/ready")).status_code == 200
    resp = await http.get("/v2/models/double/versions/2")
    assert resp.status_code == 404 and "version" in v2_error(resp)


async def test_unknown_model_is_404(http: httpx.AsyncClient) -> None:
    for method, path in [("POST", "/v2/models/nope/infer"), ("GET", "/v2/models/nope"),
                         ("GET", "/v2/models/nope/ready"), ("GET", "/v2/models/bad%20name")]:
        resp = await http.request(method, path, json=infer_body("x", "FP32", [1, 4], [0] * 4))
        assert resp.status_code == 404, (path, resp.text)
        assert "nope" in v2_error(resp) or "bad name" in v2_error(resp)
        assert resp.headers["x-redbatch-error-code"] == "unknown_model"


BAD_REQUESTS: list[tuple[str, Any, str]] = [
    ("wrong datatype", infer_body("x", "FP64", [1, 4], [1, 2, 3, 4]), "FP32, got FP64"),
    ("unknown datatype", infer_body("x", "BYTES", [1, 4], ["a"] * 4), "not supported"),
    ("shape/data mismatch", infer_body("x", "FP32", [2, 4], [1, 2, 3, 4]), "8 elements"),
    ("row shape", infer_body("x", "FP32", [2, 3], [1] * 6), "[-1, 4]"),
    ("unknown input", infer_body("z", "FP32", [1, 4], [1] * 4), "unknown input 'z'"),
    ("missing inputs", {"id": "q"}, "'inputs'"),
    ("two inputs", {"inputs": [infer_body("x", "FP32", [1, 4], [1] * 4)["inputs"][0]] * 2},
     "2 times"),
    ("unknown output", infer_body("x", "FP32", [1, 4], [1] * 4, outputs=[{"name": "q"}]),
     "unknown output 'q'"),
    ("batch dim 0", infer_body("x", "FP32", [0, 4], []), "batch dimension"),
    ("no data", {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4]}]}, "'data'"),
    ("ragged data", infer_body("x", "FP32", [2, 4], [[1, 2, 3, 4], [1]]), "rectangular"),
    ("strings", infer_body("x", "FP32", [1, 4], ["a", "b", "c", "d"]), "numbers"),
    ("float for ints", infer_body("ids", "INT64", [1, 2], [1.5, 2]), "integers"),
    ("bad timeout", infer_body("x", "FP32", [1, 4], [1] * 4, parameters={"timeout": -1}),
     "microseconds"),
    ("bad id", infer_body("x", "FP32", [1, 4], [1] * 4, id=7), "'id'"),
]


async def test_bad_requests_are_400_with_a_message(http: httpx.AsyncClient) -> None:
    for case, body, needle in BAD_REQUESTS:
        model = "inc" if body.get("inputs") and body["inputs"][0]["name"] == "ids" else "double"
        resp = await http.post(f"/v2/models/{model}/infer", json=body)
        assert resp.status_code == 400, (case, resp.text)
        assert needle in v2_error(resp), (case, resp.text)


async def test_bad_binary_requests_are_400(http: httpx.AsyncClient) -> None:
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                   "parameters": {"binary_data_size": 16}}]}).encode()
    cases = [(head + b"\0" * 12, str(len(head)), "binary_data_size"),
             (head + b"\0" * 16, "99999", "Inference-Header-Content-Length"),
             (head + b"\0" * 16, "x", "Inference-Header-Content-Length"),
             # digits to str.isdigit (superscripts, Arabic-Indic), not lengths to int()
             (head + b"\0" * 16, "\u00b2".encode("latin-1"), "Inference-Header-Content-Length"),
             (head + b"\0" * 16, "1\u00b9".encode("latin-1"), "Inference-Header-Content-Length"),
             (head + b"\0" * 16, "\u0661\u0662".encode(), "Inference-Header-Content-Length")]
    for content, length, needle in cases:
        resp = await http.post("/v2/models/double/infer", content=content,
                               headers={"Inference-Header-Content-Length": length})
        assert resp.status_code == 400 and needle in v2_error(resp), (length, resp.text)
    nan = np.array([[1, np.nan, 3, 4]], dtype=np.float32).tobytes()
    resp = await http.post("/v2/models/double/infer", content=head + nan,
                           headers={"Inference-Header-Content-Length": str(len(head))})
    assert resp.status_code == 400 and "NaN" in v2_error(resp)


async def test_parameters_timeout_gives_504(http: httpx.AsyncClient) -> None:
    started = time.monotonic()
    resp = await http.post("/v2/models/sleepy/infer", json=infer_body(
        "x", "FP32", [2, 1], [1, 2], parameters={"timeout": 200_000}))  # 200 ms
    assert resp.status_code == 504, resp.text
    assert "row 0 of 2" in v2_error(resp)
    assert resp.headers["x-redbatch-error-code"] == "deadline_exceeded"
    assert time.monotonic() - started < 0.9  # well before the 1 s forward ends


async def test_a_failing_row_fails_the_call_and_is_named(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v2/models/picky/infer",
                           json=infer_body("inputs", "INT64", [3], [1, -1, 2]))
    assert resp.status_code == 500, resp.text
    message = v2_error(resp)
    assert "row 1 of 3" in message and "negative input" in message


async def test_queue_full_is_503_with_retry_after(start_worker: Callable[..., Worker],
                                                  redis_url: str) -> None:
    start_worker([DOUBLE])
    async with gateway(redis_url, max_queue_len=2) as client:
        for _ in range(100):
            if (await client.get("/v2/health/ready")).status_code == 200:
                break
            await asyncio.sleep(0.05)
        # 100 rows travel as 4 entries of up to 32 rows: the cap of 2 entries takes 2
        resp = await client.post("/v2/models/double/infer",
                                 json=infer_body("x", "FP32", [100, 4], [1] * 400))
    assert resp.status_code == 503 and "row 64 of 100" in v2_error(resp)
    assert int(resp.headers["retry-after"]) >= 1


async def test_not_ready_without_workers(redis_url: str) -> None:
    async with gateway(redis_url) as client:
        assert (await client.get("/v2/health/live")).status_code == 200
        resp = await client.get("/v2/health/ready")
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert "no worker" in v2_error(resp)
        assert (await client.get("/v2/models/double/ready")).status_code == 404


# --- OpenAPI ----------------------------------------------------------------------------
def _validate(spec: dict[str, Any], schema_name: str, instance: Any) -> None:
    schema = {"$ref": f"#/components/schemas/{schema_name}", "components": spec["components"]}
    jsonschema.Draft202012Validator(schema).validate(instance)


async def test_openapi_describes_every_route(http: httpx.AsyncClient) -> None:
    resp = await http.get("/openapi.json")
    assert resp.status_code == 200
    spec = json.loads(resp.content)
    assert spec == json.loads(json.dumps(openapi_document()))
    assert spec["openapi"].startswith("3.") and spec["info"]["title"]
    app = create_app(CONFIG, RedisSettings("redis://127.0.0.1:1/0"))
    routes = [r for r in app.routes if isinstance(r, Route)]
    assert len(routes) >= 16
    for route in routes:
        assert route.path in spec["paths"], route.path
        for method in (route.methods or set()) - {"HEAD"}:
            operation = spec["paths"][route.path].get(method.lower())
            assert operation and operation["responses"]["200"], (method, route.path)
    for name, schema in spec["components"]["schemas"].items():
        assert isinstance(schema, dict), name
        jsonschema.Draft202012Validator.check_schema(schema)
    body = infer_body("x", "FP32", [1, 4], [1, 2, 3, 4], id="s")
    _validate(spec, "InferRequest", body)
    answer = await http.post("/v2/models/double/infer", json=body)
    _validate(spec, "InferResponse", answer.json())
    _validate(spec, "ModelMetadata", (await http.get("/v2/models/double")).json())
    _validate(spec, "V2Error", (await http.get("/v2/models/nope")).json())
    _validate(spec, "V1Models", (await http.get("/v1/models")).json())
    with pytest.raises(jsonschema.ValidationError):
        _validate(spec, "InferRequest", {"inputs": []})
    # a streaming model's v1 answer: NDJSON, or Server-Sent Events
    predicted = spec["paths"]["/v1/models/{model}/predict"]["post"]["responses"]["200"]
    assert set(predicted["content"]) == {"application/json", "application/x-ndjson",
                                         "text/event-stream"}


SUMS = Model("sums", fn=lambda xs: [float(np.sum(x)) for x in xs],
             spec=TensorSpec("float32", (3,)), output_spec=TensorSpec("float32", ()),
             input_name="x", output_name="y", policy=WINDOW)


async def test_an_output_comes_back_in_its_declared_datatype_and_flags_are_checked(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """The rows' Python floats come back FP32, as the metadata says; an output asking
    for classification or shared memory, or a binary flag that is not a boolean, is a
    400 naming it (not ignored)."""
    from tests.conftest import wait_live

    start_worker([SUMS])
    await wait_live(redis_url, "sums")
    body: dict[str, Any] = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3],
                                        "data": [1, 2, 3, 4, 5, 6]}]}
    async with gateway(redis_url) as http:
        meta = (await http.get("/v2/models/sums")).json()
        assert meta["outputs"][0]["datatype"] == "FP32"
        resp = await http.post("/v2/models/sums/infer", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["outputs"][0] == {"name": "y", "datatype": "FP32", "shape": [2],
                                             "data": [6.0, 15.0]}
        for extra, named in (({"outputs": [{"name": "y", "parameters": {
                "classification": 1}}]}, "classification"),
                ({"outputs": [{"name": "y", "parameters": {"shared_memory_region": "r"}}]},
                 "shared_memory_region"),
                ({"parameters": {"binary_data_output": "false"}}, "binary_data_output"),
                ({"outputs": [{"name": "y", "parameters": {"binary_data": 1}}]},
                 "binary_data")):
            resp = await http.post("/v2/models/sums/infer", json={**body, **extra})
            assert resp.status_code == 400 and named in resp.text, resp.text


async def test_a_nan_output_is_null_in_json_and_itself_as_binary_data(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """As http.md and v2.md say: JSON has no NaN (nor infinities)."""
    from tests.conftest import wait_live

    nans = Model("nans", fn=lambda xs: [x * np.float32("nan") for x in xs],
                 spec=TensorSpec("float32", (2,)), input_name="x", output_name="y",
                 policy=WINDOW)
    start_worker([nans])
    await wait_live(redis_url, "nans")
    async with gateway(redis_url) as gw:
        resp = await gw.post("/v1/models/nans/predict", json={"x": [1.0, 2.0]})
        assert resp.status_code == 200 and resp.json() == {"y": [None, None]}, resp.text
        body = infer_body("x", "FP32", [1, 2], [1.0, 2.0])
        resp = await gw.post("/v2/models/nans/infer", json=body)
        assert resp.status_code == 200 and resp.json()["outputs"][0]["data"] == [None, None]
        resp = await gw.post("/v2/models/nans/infer", json={
            **body, "parameters": {"binary_data_output": True}})
        size = int(resp.headers["inference-header-content-length"])
        assert np.isnan(np.frombuffer(resp.content[size:], dtype="<f4")).all()
