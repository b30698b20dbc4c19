"""``GET /openapi.json``: an OpenAPI 3.1 description of every gateway route, by hand.

``tests/test_v2.py`` checks that each route registered on the app is described here
and validates real responses against these schemas.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from redbatch import __version__
from redbatch.api.v2_tensors import V2_DATATYPES

Schema = dict[str, Any]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(description: str, schema: Schema, headers: dict[str, Any] | None = None) -> Schema:
    response: Schema = {"description": description,
                        "content": {"application/json": {"schema": schema}}}
    if headers:
        response["headers"] = headers
    return response


RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying",
                               "schema": {"type": "integer"}}}
V1_ERRORS = {
    "400": _json("malformed body or bad timeout_ms", _ref("V1Error")),
    "401": _json("API key required", _ref("V1Error")),
    "404": _json("unknown model", _ref("V1Error")),
    "413": _json("body over the limit", _ref("V1Error")),
    "415": _json("a Content-Type other than application/json", _ref("V1Error")),
    "422": _json("input does not match the model's spec", _ref("V1Error")),
    "500": _json("the model raised", _ref("V1Error")),
    "502": _json("workers crashed on this request", _ref("V1Error")),
    "503": _json("queue full, no live worker, or Redis down", _ref("V1Error"), RETRY_AFTER),
    "504": _json("deadline passed", _ref("V1Error")),
}


def _v2_errors(*statuses: str) -> dict[str, Schema]:
    text = {"400": "bad request (datatype, shape, data, names)", "401": "API key required",
            "404": "unknown model or version", "413": "body over the limit",
            "500": "the model raised", "502": "workers crashed on a row",
            "503": "queue full, no live worker, or Redis down", "504": "deadline passed"}
    return {s: _json(text[s], _ref("V2Error"), RETRY_AFTER if s == "503" else None)
            for s in statuses}


def _param(name: str, description: str) -> Schema:
    return {"name": name, "in": "path", "required": True, "description": description,
            "schema": {"type": "string"}}


MODEL = _param("name", "model name")
VERSION = _param("version", "model version (a model served without versions has "
                 "version \"1\")")


def _get(summary: str, ok: Schema, errors: dict[str, Schema], tag: str,
         params: list[Schema] | None = None) -> Schema:
    operation: Schema = {"summary": summary, "tags": [tag], "responses": {"200": ok, **errors}}
    if params:
        operation["parameters"] = params
    return {"get": operation}


EMPTY_OK: Schema = {"description": "yes (empty body)"}


def _generate(summary: str, ok: Schema, params: list[Schema] | None = None) -> Schema:
    """Triton's generate extension (``v2_generate``): the body is the model's input."""
    return {"post": {"summary": summary, "tags": ["v2"], "parameters": params or [MODEL],
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": {"type": "object"}}}},
                     "responses": {"200": ok, **_v2_errors("400", "404", "503", "504")}}}


def _infer(params: list[Schema]) -> Schema:
    binary = {"description": "JSON header, then binary tensor data (binary data extension)",
              "headers": {"Inference-Header-Content-Length": {
                  "description": "length of the JSON header", "schema": {"type": "integer"}}},
              "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                  "format": "binary"}}}}
    ok = _json("the stacked output tensor", _ref("InferResponse"))
    ok["content"].update(binary["content"])
    ok["headers"] = binary["headers"]
    return {"post": {
        "summary": "run the model on a batch: one redbatch request per row", "tags": ["v2"],
        "parameters": params,
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": _ref("InferRequest")},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        "responses": {"200": ok, **_v2_errors("400", "401", "404", "413", "500", "502",
                                              "503", "504")}}}


def _query(name: str, description: str, schema: Schema) -> Schema:
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": schema}


def _predict_get() -> Schema:
    """A scalar or short list input in the query string: ``?inputs=41``."""
    number = {"type": "number"}
    value = _query("inputs", "the model's input field (this name stands for the model's "
                   "input_name, \"inputs\" unless it names another): a JSON number; a "
                   "repeated key or a comma list (1,2,3) makes a list (a model with named "
                   "inputs takes each under its own name: ?x=1,2&scale=3)",
                   {"oneOf": [number, {"type": "array", "items": number}]})
    value["style"], value["explode"] = "form", True
    return {
        "summary": "one prediction, the input in the query string (?inputs=41)",
        "tags": ["v1"],
        "parameters": [_param("model", "model name"), value,
                       _query("timeout_ms", "shortens the deadline, as the body's field",
                              {"type": "number", "exclusiveMinimum": 0})],
        "responses": {"200": _json("the model's output under its output name",
                                   {"type": "object"}),
                      **{k: v for k, v in V1_ERRORS.items() if k != "415"}}}


def _config_path() -> Schema:
    """``/v1/models/{model}/config``: the live knobs (docs/models.md)."""
    return _live_path("a model's live knobs",
                      "change a model's live knobs (null drops an override)",
                      _json("the stored overrides and the effective values", _ref("V1Config")),
                      "an unknown knob or a bad value")


def _versions_path() -> Schema:
    """``/v1/models/{model}/versions``: the versions and their traffic split."""
    return _live_path("a model's versions: weight, share, latest, draining, live workers",
                      "change the split ({\"weights\": {\"1\": 95, \"2\": 5}}), pin "
                      "\"latest\", \"drain\" or \"undrain\" a version",
                      _json("the versions", {"type": "object"}),
                      "a bad weight or field")


def _live_path(show: str, change: str, answer: Schema, bad: str) -> Schema:
    """GET shows, PATCH (a JSON object) changes, a model's live settings."""
    errors = {k: V1_ERRORS[k] for k in ("401", "404", "503")}
    return {
        "get": {"summary": show, "tags": ["v1"],
                "parameters": [_param("model", "model name")],
                "responses": {"200": answer, **errors}},
        "patch": {"summary": change,
                  "tags": ["v1"], "parameters": [_param("model", "model name")],
                  "requestBody": {"required": True, "content": {"application/json": {
                      "schema": {"type": "object", "additionalProperties": True}}}},
                  "responses": {"200": answer, **errors,
                                "400": _json("body is not a JSON object", _ref("V1Error")),
                                "422": _json(bad, _ref("V1Error"))}},
    }


def _pinned(predict: Schema) -> Schema:
    """``predict``'s operations, for a pinned version (one more path parameter)."""
    version = _param("version", "the model's version (404 when it has none of that name)")
    return {method: {**operation, "parameters": [*operation["parameters"][:1], version,
                                                 *operation["parameters"][1:]]}
            for method, operation in predict.items()}


STREAM_LINES = ("a streaming model's chunks, one JSON object each ({\"seq\", \"<output_name>\"}), "
                "then a last one ({\"id\", \"last\": true, \"timings\"} or "
                "{\"error\"})")


def _v1_answer() -> Schema:
    """200: the output, or a streaming model's chunks (NDJSON, or SSE on request)."""
    answer = _json("the model's output under its output name; " + STREAM_LINES + ": "
                   "newline-delimited JSON, or Server-Sent Events (`data: <object>`) "
                   "with `Accept: text/event-stream`", {"type": "object"})
    lines = {"type": "string", "description": STREAM_LINES}
    answer["content"].update({"application/x-ndjson": {"schema": lines},
                              "text/event-stream": {"schema": lines}})
    return answer


def _v1_paths() -> dict[str, Schema]:
    predict = {"post": {
        "summary": "one prediction", "tags": ["v1"],
        "parameters": [_param("model", "model name")],
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": _ref("V1PredictRequest")}}},
        "responses": {"200": _v1_answer(), **V1_ERRORS}}}
    predict["get"] = _predict_get()
    return {
        "/v1/models/{model}/predict": predict,
        "/v1/models/{model}/versions/{version}/predict": _pinned(predict),
        "/v1/models/{model}/versions": _versions_path(),
        "/v1/models": _get("models with their spec, policy, queue depth and workers",
                           _json("models", _ref("V1Models")), {"503": V1_ERRORS["503"]}, "v1"),
        "/v1/models/{model}/config": _config_path(),
        "/v1/stats": _get("replies this gateway process received",
                          _json("counters", {"type": "object", "additionalProperties":
                                             {"type": "integer"}}), {}, "v1"),
        "/healthz": _get("the process runs", _json("ok", {"type": "object"}), {}, "health"),
        "/readyz": _get("Redis answers and some worker is live",
                        _json("ready", {"type": "object"}), {"503": V1_ERRORS["503"]},
                        "health"),
        "/openapi.json": _get("this document", _json("OpenAPI 3.1", {"type": "object"}), {},
                              "meta"),
    }


def _v2_paths() -> dict[str, Schema]:
    model, version = "/v2/models/{name}", "/v2/models/{name}/versions/{version}"
    meta = _json("model metadata", _ref("ModelMetadata"))
    missing = _v2_errors("404", "503")
    return {
        "/v2": _get("server metadata", _json("server", _ref("ServerMetadata")), {}, "v2"),
        "/v2/health/live": _get("the server is live", EMPTY_OK, {}, "v2"),
        "/v2/health/ready": _get("Redis answers and some worker is live", EMPTY_OK,
                                 _v2_errors("503"), "v2"),
        model: _get("model metadata", meta, missing, "v2", [MODEL]),
        version: _get("model metadata", meta, missing, "v2", [MODEL, VERSION]),
        f"{model}/config": _get("Triton-style model configuration",
                                _json("config", {"type": "object"}), _v2_errors("404"),
                                "v2", [MODEL]),
        f"{version}/config": _get("Triton-style configuration of a model version",
                                  _json("config", {"type": "object"}), _v2_errors("404"),
                                  "v2", [MODEL, VERSION]),
        f"{model}/ready": _get("the model has a live worker", EMPTY_OK, missing, "v2",
                               [MODEL]),
        f"{version}/ready": _get("the model has a live worker", EMPTY_OK, missing, "v2",
                                 [MODEL, VERSION]),
        f"{model}/infer": _infer([MODEL]),
        f"{version}/infer": _infer([MODEL, VERSION]),
        **_generate_paths(model, [MODEL]),
        **_generate_paths(version, [MODEL, VERSION]),
        **_v2_repository_paths(model, version),
    }


def _generate_paths(path: str, params: list[Schema]) -> dict[str, Schema]:
    return {
        f"{path}/generate": _generate("a streaming model's chunks, joined",
                                      _json("text_output", {"type": "object"}), params),
        f"{path}/generate_stream": _generate(
            "a streaming model's chunks as Server-Sent Events",
            {"description": "one event per chunk, `data: <JSON object>` "
             "({\"model_name\", \"model_version\", \"text_output\" or \"output\", \"seq\"}), "
             "then a last one ({..., \"last\": true, \"timings\"}, or {\"error\", \"code\"})",
             "content": {"text/event-stream": {"schema": {"type": "string"}}}}, params),
    }


def _v2_repository_paths(model: str, version: str) -> dict[str, Schema]:
    stats = _json("statistics from the live workers' heartbeats", _ref("ModelStats"))
    index = _json("every model a worker registered", {"type": "array", "items": _ref(
        "RepositoryIndexEntry")})
    return {
        "/v2/repository/index": {"post": {
            "summary": "the model repository index (models and their state)", "tags": ["v2"],
            "requestBody": {"required": False, "content": {"application/json": {"schema": {
                "type": "object", "properties": {"ready": {"type": "boolean"}}}}}},
            "responses": {"200": index, **_v2_errors("400", "401", "503")}}},
        "/v2/models/stats": _get("statistics of every model", stats,
                                 _v2_errors("401", "503"), "v2"),
        f"{model}/stats": _get("statistics of every version of a model", stats,
                               _v2_errors("404", "503"),
                               "v2", [MODEL]),
        f"{version}/stats": _get("statistics of a model version", stats,
                                 _v2_errors("404", "503"), "v2", [MODEL, VERSION]),
    }


def _stats_schemas() -> dict[str, Schema]:
    count = {"type": "integer", "minimum": 0}
    stat = {"type": "object", "required": ["count", "ns"],
            "properties": {"count": count, "ns": count}}
    one = {"type": "object", "required": ["name", "version", "inference_count",
                                          "execution_count", "inference_stats"],
           "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                          "last_inference": count, "inference_count": count,
                          "execution_count": count, "batch_stats": {"type": "array"},
                          "inference_stats": {"type": "object",
                                              "additionalProperties": stat}}}
    return {
        "ModelStats": {"type": "object", "required": ["model_stats"],
                       "properties": {"model_stats": {"type": "array", "items": one}}},
        "RepositoryIndexEntry": {
            "type": "object", "required": ["name", "version", "state", "reason"],
            "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                           "state": {"type": "string", "enum": ["READY", "UNAVAILABLE"]},
                           "reason": {"type": "string"}}},
    }


def _tensor_schemas() -> dict[str, Schema]:
    shape = {"type": "array", "items": {"type": "integer", "minimum": -1}}
    datatype = {"type": "string", "enum": list(V2_DATATYPES.values())}
    data = {"type": "array", "description": "row-major, flat (or nested) numbers"}
    tensor = {"type": "object", "required": ["name", "shape", "datatype"],
              "properties": {"name": {"type": "string"}, "shape": shape, "datatype": datatype,
                             "parameters": {"type": "object", "properties": {
                                 "binary_data_size": {"type": "integer", "minimum": 0}}},
                             "data": data}}
    return {
        "MetadataTensor": {"type": "object", "required": ["name", "datatype", "shape"],
                           "properties": {"name": {"type": "string"},
                                          "datatype": {"type": "string"}, "shape": shape}},
        "InferInputTensor": tensor,
        "InferOutputTensor": tensor,  # the same fields both ways
        "RequestedOutput": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "parameters": {"type": "object", "properties": {
                "binary_data": {"type": "boolean"}}}}},
    }


def _v2_schemas() -> dict[str, Schema]:
    return {
        **_tensor_schemas(),
        **_stats_schemas(),
        "V2Error": {"type": "object", "required": ["error"],
                    "properties": {"error": {"type": "string"}}},
        "ServerMetadata": {"type": "object", "required": ["name", "version", "extensions"],
                           "properties": {"name": {"type": "string"},
                                          "version": {"type": "string"},
                                          "extensions": {"type": "array",
                                                         "items": {"type": "string"}}}},
        "ModelMetadata": {
            "type": "object", "required": ["name", "platform", "inputs", "outputs"],
            "properties": {"name": {"type": "string"}, "platform": {"type": "string"},
                           "versions": {"type": "array", "items": {"type": "string"}},
                           "inputs": {"type": "array", "items": _ref("MetadataTensor")},
                           "outputs": {"type": "array", "items": _ref("MetadataTensor")}}},
        "InferRequest": {
            "type": "object", "required": ["inputs"],
            "properties": {
                "id": {"type": "string"},
                "parameters": {"type": "object", "properties": {
                    "timeout": {"type": "number", "exclusiveMinimum": 0,
                                "description": "microseconds; shortens the deadline only"},
                    "priority": {"type": "integer", "minimum": 0,
                                 "description": "priority level, 1 most urgent; 0: the "
                                                "model's default"},
                    "binary_data_output": {"type": "boolean"}}},
                "inputs": {"type": "array", "minItems": 1,
                           "description": "one per input of the model",
                           "items": _ref("InferInputTensor")},
                "outputs": {"type": "array", "items": _ref("RequestedOutput")}}},
        "InferResponse": {
            "type": "object", "required": ["model_name", "outputs"],
            "properties": {"model_name": {"type": "string"},
                           "model_version": {"type": "string"}, "id": {"type": "string"},
                           "outputs": {"type": "array", "items": _ref("InferOutputTensor")}}},
    }


def _v1_schemas() -> dict[str, Schema]:
    return {
        "V1Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["code", "message"],
            "properties": {"code": {"type": "string"}, "message": {"type": "string"}}}}},
        "V1PredictRequest": {
            "type": "object", "description": "{\"<input_name>\": value}; for a model with "
            "named inputs {\"<input_name>\": {\"<input>\": value, ...}}",
            "properties": {"timeout_ms": {"type": "number", "exclusiveMinimum": 0}},
            "additionalProperties": True},
        "V1Models": {"type": "object", "required": ["models"], "properties": {"models": {
            "type": "array", "items": {"type": "object", "required": ["name"],
                                       "properties": {"name": {"type": "string"},
                                                      "streaming": {"type": "boolean"}}}}}},
        "V1Config": {"type": "object", "required": ["overrides", "effective"], "properties": {
            "overrides": {"type": "object"}, "effective": {"type": "object"}}},
    }


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "redbatch gateway", "version": __version__,
                 "description": "v1 (redbatch) and v2 (KServe Open Inference Protocol) "
                                "routes; see README.md and docs/v2.md"},
        "paths": {**_v1_paths(), **_v2_paths()},
        "security": [{}, {"bearer": []}, {"apiKey": []}],  # a key only when one is set
        "components": {
            "schemas": {**_v1_schemas(), **_v2_schemas()},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header",
                                           "name": "X-API-Key"}}},
    }


async def openapi_json(request: Request) -> Response:
    return JSONResponse(openapi_document())


def openapi_routes() -> list[Route]:
    return [Route("/openapi.json", openapi_json, methods=["GET"])]
