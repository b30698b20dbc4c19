"""Batches by cost: ``max_batch_cost``, ``batch_size_fn`` and ``oversize`` cut a claimed
batch into passes whose total cost stays within the budget."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from redbatch import Client
from redbatch.config import WorkerConfig
from redbatch.demo import TOKENS
from redbatch.errors import ConfigError, InvalidKnob, InvalidPayload, ModelError
from redbatch.knobs import check
from redbatch.spec import TensorSpec
from redbatch.worker import cost
from redbatch.worker.forward import Forwarder
from redbatch.worker.model import Model, batch
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from tests.conftest import wait_live
from tests.test_gateway import gateway
from tests.test_packing import rows_taken

pytestmark = pytest.mark.timeout(60)

PER_TOKEN = TensorSpec("int64", (None,))
BEATING = WorkerConfig(block_timeout_s=0.2, heartbeat_interval_s=1.0, lease_ttl_s=3.0)


class Shapes:
    """A padded model's batch function that notes each pass's shape and echoes."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, batch: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]) -> Any:
        padded, _lengths = batch
        self.shapes.append(tuple(padded.shape))
        return padded


def tokens_model(name: str, fn: Shapes, policy: BatchPolicy, **kw: Any) -> Model:
    """A variable-length int64 model (``echo_tokens``'s spec) padded by the worker."""
    return Model(name, fn=fn, policy=policy, spec=TOKENS, output_spec=PER_TOKEN,
                 input_name="x", output_name="y", stack=True, inline=True, **kw)


def lengths_model(passes: list[list[int]], policy: BatchPolicy, **kw: Any) -> Model:
    """A list model that notes the items of each pass and answers their lengths."""
    def fn(items: list[Any]) -> list[int]:
        passes.append([len(x) for x in items])
        return [len(x) for x in items]

    return Model("lens", fn=fn, policy=policy, **kw)


async def forward(model: Model, inputs: list[Any]) -> tuple[list[Any], Forwarder]:
    with ThreadPoolExecutor(1) as executor:
        fwd = Forwarder(model, model.bind("cpu"), executor)
        return await fwd.run_batches(inputs), fwd


def ids(n: int, start: int = 1) -> np.ndarray[Any, Any]:
    return np.arange(start, start + n, dtype=np.int64)


# --- cutting passes ----------------------------------------------------------------------
def test_cut_closes_a_pass_before_the_budget_or_the_size() -> None:
    assert cost.cut([3, 3, 3, 3, 5, 6], 32, 10) == [(0, 3), (3, 5), (5, 6)]
    assert cost.cut([1.0] * 5, 2, 100) == [(0, 2), (2, 4), (4, 5)]
    assert cost.cut([4, 4, 2], 32, 10) == [(0, 3)]  # exactly the budget fits
    assert cost.cut([], 32, 10) == []


def test_an_item_over_the_budget_gets_a_pass_of_its_own() -> None:
    assert cost.cut([1, 50, 1, 1], 32, 10) == [(0, 1), (1, 2), (2, 4)]
    assert cost.cut([50, 60], 32, 10) == [(0, 1), (1, 2)]


def test_the_budget_is_max_batch_cost_else_max_batch_size_with_a_cost_fn() -> None:
    assert cost.budget(BatchPolicy(), None) is None
    assert cost.budget(BatchPolicy(max_batch_cost=64), None) == 64
    assert cost.budget(BatchPolicy(max_batch_size=8), len) == 8.0  # Ray's rule
    assert cost.budget(BatchPolicy(max_batch_size=8, max_batch_cost=100), len) == 100


# --- the forward step ----------------------------------------------------------------------
async def test_padded_tokens_bound_each_pass() -> None:
    fn = Shapes()
    model = tokens_model("toks", fn, BatchPolicy(max_batch_cost=64))
    inputs = [ids(16, start=100 * i) for i in range(16)]
    outputs, fwd = await forward(model, inputs)
    assert [np.asarray(o).tolist() for o in outputs] == [x.tolist() for x in inputs]
    assert fn.shapes == [(4, 16)] * 4  # 4 rows x bucket 16 = 64 padded tokens
    assert fwd.take_passes() == [4, 4, 4, 4]
    # mixed lengths: each bucket on its own budget (bucket 8: 8 items, bucket 32: 2)
    fn.shapes.clear()
    outputs, _ = await forward(model, [ids(5)] * 9 + [ids(20)] * 3)
    assert sorted(fn.shapes) == [(1, 8), (1, 32), (2, 32), (8, 8)]
    assert all(rows * length <= 64 for rows, length in fn.shapes)


async def test_max_batch_size_still_bounds_the_items() -> None:
    fn = Shapes()
    model = tokens_model("toks", fn, BatchPolicy(max_batch_size=3, max_batch_cost=1000))
    await forward(model, [ids(4)] * 7)
    assert fn.shapes == [(3, 4), (3, 4), (1, 4)]


async def test_batch_size_fn_sums_close_passes_before_the_budget() -> None:
    passes: list[list[int]] = []
    model = lengths_model(passes, BatchPolicy(max_batch_cost=10), batch_size_fn=len)
    lengths = [3, 3, 3, 3, 5, 6, 2]
    outputs, _ = await forward(model, [list(range(n)) for n in lengths])
    assert outputs == lengths
    assert passes == [[3, 3, 3], [3, 5], [6, 2]]
    assert all(sum(p) <= 10 for p in passes)


async def test_batch_size_fn_alone_takes_max_batch_size_as_budget() -> None:
    passes: list[list[int]] = []
    model = lengths_model(passes, BatchPolicy(max_batch_size=8), batch_size_fn=len)
    await forward(model, [[0] * 3] * 6)
    assert passes == [[3, 3], [3, 3], [3, 3]]


async def test_an_oversize_item_runs_alone_by_default() -> None:
    fn = Shapes()
    model = tokens_model("toks", fn, BatchPolicy(max_batch_cost=64))
    inputs = [ids(3), ids(100), ids(4)]  # 100 -> bucket 128: over the budget
    outputs, _ = await forward(model, inputs)
    assert [np.asarray(o).tolist() for o in outputs] == [x.tolist() for x in inputs]
    assert sorted(fn.shapes) == [(1, 128), (2, 4)]


async def test_refuse_answers_the_oversize_item_and_runs_its_batch_mates() -> None:
    fn = Shapes()
    model = tokens_model("toks", fn, BatchPolicy(max_batch_cost=64), oversize="refuse")
    inputs = [ids(3), ids(100), ids(4)]
    outputs, fwd = await forward(model, inputs)
    assert isinstance(outputs[1], InvalidPayload)
    assert re.search(r"costs 128, over the model's max_batch_cost of 64", str(outputs[1]))
    assert [np.asarray(outputs[i]).tolist() for i in (0, 2)] == [ids(3).tolist(),
                                                                 ids(4).tolist()]
    assert fn.shapes == [(2, 4)] and fwd.take_passes() == [2]


async def test_a_failing_cost_fails_its_item_only() -> None:
    passes: list[list[int]] = []

    def fussy(item: list[int]) -> float:
        if not item:
            raise ValueError("empty")
        return float("nan") if item[0] == 9 else len(item)

    model = lengths_model(passes, BatchPolicy(max_batch_cost=10), batch_size_fn=fussy)
    outputs, _ = await forward(model, [[1, 2], [], [9], [3]])
    assert outputs[0] == 2 and outputs[3] == 1
    assert isinstance(outputs[1], ModelError) and "ValueError: empty" in str(outputs[1])
    assert isinstance(outputs[2], ModelError) and "nan" in str(outputs[2])
    assert passes == [[2, 1]]


async def test_a_model_without_cost_settings_computes_no_cost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no(*_args: Any) -> Any:
        raise AssertionError("a cost was computed")

    monkeypatch.setattr(cost, "item_costs", no)
    fn = Shapes()
    outputs, _fwd = await forward(tokens_model("toks", fn, BatchPolicy(max_batch_size=4)),
                                 [ids(16)] * 9)
    assert fn.shapes == [(4, 16), (4, 16), (1, 16)] and len(outputs) == 9
    passes: list[list[int]] = []
    await forward(lengths_model(passes, BatchPolicy(max_batch_size=4)), [[1]] * 6)
    assert passes == [[1] * 4, [1] * 2]


# --- settings ---------------------------------------------------------------------------
def test_max_batch_cost_is_checked() -> None:
    assert check("max_batch_cost", 64) == 64.0 and check("max_batch_cost", None) is None
    for value, words in [(0, "> 0"), (-3, "> 0"), ("64", "a number"), (True, "a number")]:
        with pytest.raises(InvalidKnob, match=re.escape(words)):
            check("max_batch_cost", value)
    with pytest.raises(ConfigError, match="max_batch_cost must be > 0"):
        BatchPolicy(max_batch_cost=0)
    with pytest.raises(ConfigError, match="oversize"):
        Model("m", fn=lambda xs: xs, oversize="drop")


def test_batch_and_meta_carry_the_cost_settings() -> None:
    @batch(max_batch_cost=256, batch_size_fn=len, oversize="refuse")
    def costly(items: list[Any]) -> list[Any]:
        return items

    assert costly.policy.max_batch_cost == 256
    assert costly.batch_size_fn is len and costly.oversize == "refuse"
    meta = costly.meta()
    assert meta["policy"]["max_batch_cost"] == 256 and meta["defaults"]["max_batch_cost"] == 256
    assert BatchPolicy.from_mapping({"max_batch_cost": 8}).max_batch_cost == 8


# --- a real worker -----------------------------------------------------------------------
COST_64 = BatchPolicy(max_batch_size=32, batch_wait_timeout_s=0.2, max_batch_cost=64)


async def serve(start_worker: Callable[..., Worker], redis_url: str, name: str,
                policy: BatchPolicy = COST_64, **kw: Any) -> tuple[Shapes, Worker]:
    """A live worker of a ``tokens_model`` whose passes are noted."""
    fn = Shapes()
    worker = start_worker([tokens_model(name, fn, policy, **kw)], config=BEATING)
    await wait_live(redis_url, name)
    return fn, worker


async def test_sixteen_requests_run_in_passes_of_at_most_64_padded_tokens(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    fn, _ = await serve(start_worker, redis_url, "cost16")
    inputs = [ids(16, start=1000 * i).tolist() for i in range(16)]
    async with Client(redis_url) as client:
        outputs = await client.predict_many("cost16", inputs, timeout_s=20)
    assert [np.asarray(o).tolist() for o in outputs] == inputs
    assert sum(rows for rows, _ in fn.shapes) == 16
    assert all(length == 16 and rows * length <= 64 for rows, length in fn.shapes)
    assert len(fn.shapes) >= 4


async def test_a_refused_request_gets_invalid_payload_and_the_rest_succeed(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    fn, _ = await serve(start_worker, redis_url, "refusing", oversize="refuse")
    inputs = [ids(8).tolist(), ids(200).tolist(), ids(5).tolist()]
    async with Client(redis_url) as client:
        outputs = await client.predict_many("refusing", inputs, timeout_s=20,
                                            return_exceptions=True)
    assert isinstance(outputs[1], InvalidPayload) and "max_batch_cost of 64" in str(outputs[1])
    assert [np.asarray(outputs[i]).tolist() for i in (0, 2)] == [inputs[0], inputs[2]]
    assert all(length != 256 for _, length in fn.shapes)


async def test_the_rows_of_a_multi_row_request_count_one_by_one(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    fn, _ = await serve(start_worker, redis_url, "rows")
    rows = np.stack([ids(16, start=100 * i) for i in range(10)])  # one request, 10 rows
    async with Client(redis_url) as client:
        await rows_taken(client, "rows")
        [future] = await client.submit_many("rows", [rows], timeout_s=20, batched=True)
        outputs = await future
    assert np.asarray(outputs).tolist() == rows.tolist()
    assert sorted(fn.shapes) == [(2, 16), (4, 16), (4, 16)]


async def test_max_batch_cost_changes_live_and_bad_values_get_422(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    fn, worker = await serve(start_worker, redis_url, "livecost", replace(COST_64,
                             max_batch_cost=None))
    inputs = [ids(16, start=50 * i).tolist() for i in range(8)]
    async with Client(redis_url) as client:
        answer = await client.configure("livecost", max_batch_cost=32)
        assert answer["effective"]["max_batch_cost"] == 32
        with pytest.raises(InvalidKnob, match="max_batch_cost"):
            await client.configure("livecost", max_batch_cost=0)
        runner = worker.runners[0]
        for _ in range(60):  # applied with the next heartbeat
            if runner.model.policy.max_batch_cost == 32:
                break
            await asyncio.sleep(0.05)
        assert runner.model.policy.max_batch_cost == 32
        outputs = await client.predict_many("livecost", inputs, timeout_s=20)
    assert [np.asarray(o).tolist() for o in outputs] == inputs
    assert fn.shapes and all(shape == (2, 16) for shape in fn.shapes)
    async with gateway(redis_url) as http:
        for bad in (0, -1, "x"):
            resp = await http.patch("/v1/models/livecost/config", json={"max_batch_cost": bad})
            assert resp.status_code == 422 and "max_batch_cost" in resp.text
        for _ in range(60):  # the meta the worker republishes with its heartbeat
            listed = (await http.get("/v1/models")).json()["models"]
            meta = next(m for m in listed if m["name"] == "livecost")
            if meta["policy"]["max_batch_cost"] == 32:
                break
            await asyncio.sleep(0.05)
        assert meta["policy"]["max_batch_cost"] == 32
        assert meta["defaults"]["max_batch_cost"] is None


def test_replace_keeps_the_cost_settings() -> None:
    model = tokens_model("toks", Shapes(), BatchPolicy(max_batch_cost=64), oversize="refuse",
                         batch_size_fn=len)
    copy = replace(model, name="toks2")
    assert (copy.oversize, copy.batch_size_fn, copy.policy.max_batch_cost) == (
        "refuse", len, 64)


async def test_a_refused_row_fails_alone_in_its_multi_row_request(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    def heavy_zeros(row: np.ndarray[Any, Any]) -> float:
        return 100.0 if row[0] == 0 else float(len(row))

    fn, _ = await serve(start_worker, redis_url, "rowcost", oversize="refuse",
                        batch_size_fn=heavy_zeros)
    rows = np.stack([ids(16, start=100 * i) for i in range(4)])  # row 0 starts at 0
    async with Client(redis_url) as client:
        await rows_taken(client, "rowcost")
        [future] = await client.submit_many("rowcost", [rows], timeout_s=20, batched=True,
                                            reply=True)
        reply = await future
    assert list(reply.row_errors) == [0]
    code, message = reply.row_errors[0]
    assert code == InvalidPayload.code and "costs 100" in message
    assert [np.asarray(o).tolist() for o in reply.payload[1:]] == rows[1:].tolist()
    assert fn.shapes == [(3, 16)]  # 16 x 3 = 48 <= 64
