"""End to end through HTTP and real worker processes (spawned by the CLI)."""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import Callable

import httpx
import numpy as np
import orjson
import pytest
import torch

from redbatch import Client
from redbatch.bench import textcls
from redbatch.bench.mlp import build_mlp
from redbatch.pipelines.tokenizer import token_ids
from tests.conftest import Proc, free_port, redbatch_cmd, wait_http, wait_live, wait_registered
from tests.test_textcls import REFERENCE

pytestmark = pytest.mark.e2e
W2_X = [i / 64 for i in range(64)]


@pytest.fixture
def stack(spawn: Callable[..., Proc], redis_url: str) -> tuple[str, Proc, Proc]:
    """A real worker process (demo models) and a real gateway process."""
    port = free_port()
    worker = spawn(redbatch_cmd("worker", "redbatch.demo:models", "--redis-url", redis_url,
                                "--replicas", "1", "--device", "cpu", "--threads", "1"),
                   name="worker")
    gateway = spawn(redbatch_cmd("gateway", "--redis-url", redis_url, "--port", str(port)),
                    name="gateway")
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/readyz", 60, gateway)
    wait_registered(redis_url)
    return base, worker, gateway


def reference_w2() -> np.ndarray:
    with torch.inference_mode():
        return build_mlp()(torch.tensor([W2_X])).numpy()[0]


async def test_http_predict_through_real_processes(stack: tuple[str, Proc, Proc]) -> None:
    base, _worker, _gateway = stack
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        resp = await http.post("/v1/models/mlp/predict", json={"x": W2_X})
        assert resp.status_code == 200, resp.text
        np.testing.assert_allclose(resp.json()["y"], reference_w2(), atol=1e-5)
        echo = await http.post("/v1/models/echo/predict", json={"x": [0.5, 1.5]})
        assert echo.json() == {"y": [0.5, 1.5]}
        pair = await http.post("/v1/models/pair/predict",
                               json={"inputs": {"x": [0, 3, 0, 4], "scale": 2}})
        assert pair.json() == {"outputs": {"y": [0.0, 6.0, 0.0, 8.0], "norm": 10.0}}
        models = (await http.get("/v1/models")).json()["models"]
        assert {m["name"] for m in models} == {"mlp", "echo", "echo_tokens", "textcls", "adder",
                                               "pair", "generate", "tok",
                                               "classify_text"}
        assert [m["name"] for m in models if m["streaming"]] == ["generate"]
        sse = await http.post("/v1/models/generate/predict",
                              json={"prompt": "hello", "max_tokens": 16},
                              headers={"accept": "text/event-stream"})
        events = [orjson.loads(e[len("data: "):]) for e in sse.text.split("\n\n") if e]
        assert [e["seq"] for e in events[:-1]] == list(range(16)) and events[-1]["last"], sse.text
        v2 = await http.post("/v2/models/generate/generate_stream",
                             json={"text_input": "hello", "max_tokens": 16})
        assert v2.text.count("data: ") == 17
        assert all(m["live_workers"] == 1 for m in models)
        assert {m["name"]: m["kind"] for m in models if m["kind"] == "pipeline"} == {
            "classify_text": "pipeline"}
        scores = await http.post("/v1/models/classify_text/predict",
                                 json={"text": "some words"})
        assert scores.status_code == 200, scores.text
        ids = token_ids("some words").tolist()  # the stages called one after the other
        direct = await http.post("/v1/models/textcls/predict", json={"input_ids": ids})
        np.testing.assert_allclose(scores.json()["logits"], direct.json()["logits"],
                                   atol=1e-5)


async def test_textcls_serves_bodies_of_different_lengths(stack: tuple[str, Proc, Proc],
                                                         redis_url: str) -> None:
    """W3's classifier through a real worker and gateway: bodies of 8, 11 and 458 tokens
    sent together (the worker pads them by bucket) get the anchors' batch-1 logits, and
    so do the same bodies padded by the caller (to 512, on the right or on the left) with
    an attention_mask that says so: the gateway cuts them to their real tokens."""
    base, _worker, _gateway = stack
    await wait_live(redis_url, "textcls")
    bodies = textcls.bodies()
    padded = [{"input_ids": bodies[20]["input_ids"] + [0] * (512 - len(bodies[20]["input_ids"])),
               "attention_mask": [1] * len(bodies[20]["input_ids"])
               + [0] * (512 - len(bodies[20]["input_ids"]))},
              {"input_ids": [0] * 3 + bodies[0]["input_ids"],
               "attention_mask": [0] * 3 + [1] * len(bodies[0]["input_ids"])}]
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        replies = await asyncio.gather(*(
            http.post("/v1/models/textcls/predict", json=b)
            for b in [bodies[20], bodies[0], bodies[21], *padded]))
        rows = [bodies[0]["input_ids"], bodies[20]["input_ids"]]  # v2: a batch padded
        width = max(map(len, rows))
        v2 = await http.post("/v2/models/textcls/infer", json={"inputs": [
            {"name": "input_ids", "datatype": "INT64", "shape": [2, width],
             "data": [t for r in rows for t in r + [0] * (width - len(r))]},
            {"name": "attention_mask", "datatype": "INT64", "shape": [2, width],
             "data": [m for r in rows for m in [1] * len(r) + [0] * (width - len(r))]}]})
    for i, resp in zip((20, 0, 21, 20, 0), replies, strict=True):
        assert resp.status_code == 200, resp.text
        assert list(resp.json()) == ["logits"]
        np.testing.assert_allclose(resp.json()["logits"], REFERENCE[i], atol=1e-4)
    assert v2.status_code == 200, v2.text
    (out,) = v2.json()["outputs"]
    assert out["shape"] == [2, 4]
    np.testing.assert_allclose(np.reshape(out["data"], (2, 4)), [REFERENCE[0], REFERENCE[20]],
                               atol=1e-4)


async def test_batches_fill_under_load(stack: tuple[str, Proc, Proc]) -> None:
    """64 concurrent callers against max_batch_size 32: mean batch well above 1."""
    base, worker, _gateway = stack
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as http:
        async def caller() -> list[int]:
            sizes = []
            for _ in range(10):
                resp = await http.post("/v1/models/mlp/predict", json={"x": W2_X})
                assert resp.status_code == 200, resp.text
                sizes.append(int(resp.headers["x-redbatch-batch-size"]))
            return sizes

        sizes = [s for per in await asyncio.gather(*(caller() for _ in range(64))) for s in per]
    assert max(sizes) <= 32
    assert np.mean(sizes) >= 2, f"mean batch {np.mean(sizes):.1f}"  # 1 would be no batching
    for _ in range(100):  # a batch's line is written once its replies are out: may lag
        logged = [int(n) for n in re.findall(r"model=mlp n=\d+ items=(\d+)", worker.log())]
        if sum(logged) >= len(sizes):
            break
        await asyncio.sleep(0.05)
    assert sum(logged) >= len(sizes)
    passes = [int(n) for n in re.findall(r"model=mlp n=(\d+)", worker.log())]
    assert 1 <= max(passes) <= 32  # n= is the largest forward pass, never over the cap


async def test_producer_path_with_real_worker(stack: tuple[str, Proc, Proc], redis_url: str
                                              ) -> None:
    async with Client(redis_url) as client:
        outs = await client.predict_many("mlp", [np.asarray(W2_X, dtype=np.float32)] * 40)
    assert len(outs) == 40
    np.testing.assert_allclose(outs[-1], reference_w2(), atol=1e-5)


def test_worker_stops_cleanly_on_sigterm(stack: tuple[str, Proc, Proc]) -> None:
    _base, worker, _gateway = stack
    worker.popen.send_signal(signal.SIGTERM)
    assert worker.popen.wait(40) == 0
    assert "stopped" in worker.log()
