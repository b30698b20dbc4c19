"""Variable lengths: a spec with ``max_len`` is batched by length bucket, padded to the
bucket's length, and its per-token outputs trimmed back; a batch is never split
because its shapes differ."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from redbatch import TensorSpec, knobs
from redbatch.demo import TOKENS, echo_tokens, models
from redbatch.errors import ConfigError, InvalidKnob, InvalidPayload
from redbatch.producer import Client
from redbatch.spec import ModelInfo
from redbatch.worker.forward import Forwarder
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from redbatch.worker.stats import WorkerStats
from redbatch.worker.torch_helpers import torch_model
from tests.conftest import wait_live
from tests.test_gateway import error_code, gateway
from tests.test_packing import rows_taken
from tests.test_v2 import infer_body, v2_error

# full claims: the worker waits for max_batch_size requests (3 s at most)
FULL = BatchPolicy(max_batch_size=32, batch_wait_timeout_s=3.0, allow_small_batch=False)
BUCKETS = len(TOKENS.boundaries)


async def settled(worker: Worker, items: int) -> WorkerStats:
    """The worker's stats once they count ``items`` answered items (a batch is counted
    just after its replies go out, so a caller may hear back first)."""
    stats = worker.runners[0].stats
    for _ in range(200):
        if stats.items >= items:
            return stats
        await asyncio.sleep(0.01)
    pytest.fail(f"the worker counted {stats.items} items, not {items}")


def token_ids(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(length)]


# --- the spec ------------------------------------------------------------------------
def test_default_buckets_are_powers_of_two_up_to_max_len() -> None:
    assert TOKENS.boundaries == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert TensorSpec("int64", (None,), max_len=300).boundaries[-2:] == (256, 300)
    spec = TensorSpec("int64", (None, 4), max_len=100, buckets=(16, 64, 200))
    assert spec.boundaries == (16, 64, 100)
    assert [spec.bucket_of(n) for n in (1, 16, 17, 64, 65, 100)] == [16, 16, 64, 64, 100, 100]


@pytest.mark.parametrize("kwargs", [
    {"shape": (None,), "max_len": 0}, {"shape": (4,), "max_len": 8},
    {"shape": (None, None), "max_len": 8}, {"shape": (None,), "buckets": (4,)},
    {"shape": (None,), "max_len": 8, "buckets": (4, 2)}])
def test_a_bad_variable_spec_is_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        TensorSpec("int64", **kwargs)


def test_fixed_specs_publish_the_same_meta_and_variable_ones_round_trip() -> None:
    for spec in (TensorSpec("float32", (3,)), TensorSpec("float32", (None,))):
        assert json.dumps(spec.to_json()) == json.dumps(
            {"dtype": spec.dtype, "shape": [-1 if d is None else d for d in spec.shape]})
        assert TensorSpec.from_json(spec.to_json()) == spec
    spec = TensorSpec("int64", (None, 2), max_len=100, pad_value=-1, buckets=(10, 50))
    published = spec.to_json()
    assert published == {"dtype": "int64", "shape": [-1, 2], "max_len": 100, "pad_value": -1,
                         "buckets": [10, 50, 100]}
    back = ModelInfo.from_meta({"name": "m", "spec": published}).spec
    assert back is not None and back.boundaries == spec.boundaries and back.max_len == 100


def test_an_input_over_max_len_is_refused_naming_the_field() -> None:
    TOKENS.check(list(range(512)), "x")
    with pytest.raises(InvalidPayload, match=r"x has length 513; .* 1\.\.512 "):
        TOKENS.check(list(range(513)), "x")
    with pytest.raises(InvalidPayload, match="length 0"):
        TOKENS.check(np.zeros(0, np.int64))
    with pytest.raises(InvalidPayload, match="length 600"):
        TOKENS.check_rows(np.zeros((2, 600), np.int64))


# --- the worker ----------------------------------------------------------------------
async def test_64_mixed_lengths_run_in_few_passes_and_come_back_trimmed(
        start_worker: Callable[..., Worker], redis_url: str,
        caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(7)
    lengths = [rng.randint(1, 512) for _ in range(64)]
    # passes <= buckets hit by each claim; the claims (whichever 32 each takes) hit at
    # most this many each, so the bound holds however the requests are split
    assert len({TOKENS.bucket_of(n) for n in lengths}) <= (math.ceil(64 / 32) + BUCKETS) // 2
    inputs = [token_ids(rng, n) for n in lengths]
    worker = start_worker([replace(echo_tokens(FULL), name="toks")])
    await wait_live(redis_url, "toks")
    caplog.set_level(logging.INFO, logger="redbatch.worker")
    async with Client(redis_url) as client:
        outputs = await asyncio.gather(*(client.predict("toks", x, timeout_s=20)
                                         for x in inputs))
    assert [np.asarray(out).tolist() for out in outputs] == inputs
    stats = await settled(worker, 64)
    assert stats.passes <= math.ceil(64 / 32) + BUCKETS
    assert stats.real == sum(lengths) and stats.padded >= stats.real
    assert stats.padding_waste is not None and stats.padding_waste >= 1.0
    assert stats.counters()["padded"] == stats.padded
    lines = [r.getMessage() for r in caplog.records if "model=toks n=" in r.getMessage()]
    assert lines and all(" pad=" in line and "\n" not in line for line in lines)


async def test_eight_mixed_lengths_are_padded_not_bisected(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """The (2,3), (1,3), (1,5), (2,5), (2,7) batch: stacking used to fail and the
    failure bisection split it into five passes."""
    rng = random.Random(1)
    inputs = [token_ids(rng, n) for n in (3, 3, 3, 5, 5, 5, 7, 7)]
    policy = BatchPolicy(max_batch_size=32, batch_wait_timeout_s=0.2)
    worker = start_worker([replace(echo_tokens(policy), name="toks8")])
    await wait_live(redis_url, "toks8")
    async with Client(redis_url) as client:
        outputs = await client.predict_many("toks8", inputs, timeout_s=20)
    assert [np.asarray(out).tolist() for out in outputs] == inputs
    stats = await settled(worker, 8)
    assert stats.passes <= math.ceil(8 / 32) + BUCKETS
    assert stats.pass_items == 8 and stats.real == 3 * 3 + 3 * 5 + 2 * 7


def row_sums(batch: np.ndarray[Any, Any]) -> list[float]:
    return [float(v) for v in batch.sum(axis=1)]


async def test_stacked_inputs_with_a_free_dimension_and_no_max_len_pass_by_shape(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """No max_len, so nothing to pad to: a claimed batch's inputs run in one pass per
    shape (3 here), where a failed stack used to bisect the batch."""
    policy = BatchPolicy(max_batch_size=32, batch_wait_timeout_s=0.2)
    model = Model("shapes", fn=row_sums, policy=policy, spec=TensorSpec("float32", (None,)),
                  stack=True, inline=True)
    worker = start_worker([model])
    await wait_live(redis_url, "shapes")
    inputs = [np.arange(n, dtype=np.float32) + i for i, n in enumerate((3, 5, 3, 7, 5, 3, 7, 5))]
    async with Client(redis_url) as client:
        outputs = await client.predict_many("shapes", inputs, timeout_s=20)
    assert outputs == [float(x.sum()) for x in inputs]
    stats = await settled(worker, 8)
    assert stats.passes == 3 and stats.pass_items == 8


class RowSums:
    """A torch module that records the shape of each pass."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def to(self, device: str) -> RowSums:
        return self

    def eval(self) -> RowSums:
        return self

    def __call__(self, batch: Any) -> Any:
        self.shapes.append(tuple(batch.shape))
        return batch.sum(dim=1)


async def test_a_torch_model_with_a_free_dimension_passes_by_shape(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """``torch_model`` with a free dimension and no max_len: one pass per shape, not a
    failed stack of them all bisected down to passes of one."""
    module = RowSums()
    policy = BatchPolicy(max_batch_size=16, batch_wait_timeout_s=0.3)
    start_worker([torch_model("tshapes", lambda: module, TensorSpec("float32", (None,)),
                              policy)])
    await wait_live(redis_url, "tshapes")
    lengths = (1, 2, 3, 4, 1, 2, 3, 4)
    async with Client(redis_url) as client:  # one request each, in one batch window
        outputs = await asyncio.gather(*(client.predict("tshapes", [1.0] * n, timeout_s=20)
                                         for n in lengths))
    assert outputs == [float(n) for n in lengths]
    assert sorted(module.shapes) == [(2, 1), (2, 2), (2, 3), (2, 4)]


async def test_an_unpadded_named_input_beside_a_padded_one_splits_a_bucket_by_its_shape(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """``ids`` (max_len: padded to its bucket) beside ``feat`` (a free dimension, no
    max_len: never padded): a bucket runs one pass per shape of ``feat``, not a failed
    stack bisected down to passes of one."""
    calls: list[dict[str, tuple[int, ...]]] = []

    def fn(arg: tuple[dict[str, Any], Any]) -> dict[str, Any]:
        batch, lengths = arg
        calls.append({k: v.shape for k, v in batch.items()})
        return {"n": lengths, "f": batch["feat"].sum(axis=1)}

    start_worker([Model("mixed", fn=fn, stack=True, outputs=["n", "f"],
                        policy=BatchPolicy(max_batch_size=8, batch_wait_timeout_s=0.3),
                        inputs={"ids": TensorSpec("int64", (None,), max_len=16),
                                "feat": TensorSpec("float32", (None,))})])
    await wait_live(redis_url, "mixed")
    feats = (1, 2, 1, 2)
    async with Client(redis_url) as client:
        outputs = await asyncio.gather(*(client.predict(
            "mixed", {"ids": [1, 2, 3], "feat": [1.0] * k}, timeout_s=20) for k in feats))
    assert outputs == [{"n": 3, "f": float(k)} for k in feats]
    assert sorted(c["feat"] for c in calls) == [(2, 1), (2, 2)], calls


def lengths_of(batch: dict[str, Any]) -> dict[str, list[Any]]:
    return {"n": [len(row) for row in batch["x"]], "kind": [type(m).__name__
                                                         for m in batch["meta"]]}


async def test_shape_groups_look_only_at_inputs_with_a_spec(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """Named inputs: the passes are grouped by the shapes of the inputs with a spec; one
    of any value (a ragged list, a string) neither splits them nor breaks the batch."""
    policy = BatchPolicy(max_batch_size=32, batch_wait_timeout_s=0.2)
    model = Model("loose", fn=lengths_of, policy=policy, stack=True, inline=True,
                  inputs={"x": TensorSpec("float32", (None,)), "meta": None},
                  outputs=("n", "kind"))
    worker = start_worker([model])
    await wait_live(redis_url, "loose")
    inputs = [{"x": [1.0, 2.0], "meta": [[1], [1, 2]]}, {"x": [1.0, 2.0, 3.0], "meta": "s"},
              {"x": [0.0, 1.0], "meta": {"a": 1}}]
    async with Client(redis_url) as client:
        outputs = await asyncio.gather(*(client.predict("loose", x, timeout_s=20)
                                         for x in inputs))
    assert [(o["n"], o["kind"]) for o in outputs] == [(2, "list"), (3, "str"), (2, "dict")]
    stats = await settled(worker, 3)
    assert stats.passes <= 2 * 2  # two shapes (in one or two claims)


async def test_same_length_arrays_pack_and_mixed_ones_do_not(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    policy = BatchPolicy(max_batch_size=32, batch_wait_timeout_s=0.05)
    worker = start_worker([replace(echo_tokens(policy), name="packed")])
    await wait_live(redis_url, "packed")
    inputs = [np.arange(n % 3 + 1, dtype=np.int64) + n for n in range(12)]
    async with Client(redis_url, pack_rows=32) as client:
        await rows_taken(client, "packed")
        outputs = await client.predict_many("packed", inputs, timeout_s=20)
        with pytest.raises(InvalidPayload, match="x has length 513"):
            await client.predict("packed", list(range(513)), timeout_s=20)
    assert [np.asarray(o).tolist() for o in outputs] == [x.tolist() for x in inputs]
    stats = await settled(worker, 12 + 1)  # rows of one length travelled together: 3 packs
    assert stats.entries == 3 + 1 and stats.items == 12 + 1


# --- the gateway ---------------------------------------------------------------------
async def test_the_gateway_refuses_an_over_long_input_with_422(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([m for m in models() if m.name == "echo_tokens"])
    async with gateway(redis_url) as http:
        await wait_live(redis_url, "echo_tokens")
        ok = await http.post("/v1/models/echo_tokens/predict", json={"x": [5, 6, 7]})
        assert ok.status_code == 200 and ok.json()["y"] == [5, 6, 7]
        resp = await http.post("/v1/models/echo_tokens/predict", json={"x": [1] * 513})
        assert resp.status_code == 422 and error_code(resp) == "invalid_payload"
        assert "x has length 513" in resp.json()["error"]["message"]
        resp = await http.post("/v2/models/echo_tokens/infer",
                               json=infer_body("x", "INT64", [1, 600], [0] * 600))
        assert resp.status_code == 400 and "length 600" in v2_error(resp)  # v2's 422
        assert resp.headers["x-redbatch-error-code"] == "invalid_payload"
        resp = await http.post("/v2/models/echo_tokens/infer",
                               json=infer_body("x", "INT64", [2, 3], [1, 2, 3, 4, 5, 6]))
        assert resp.status_code == 200, resp.text


# --- the forward step: torch_model, trimming -------------------------------------------
class Doubled:
    """A module whose forward takes (padded, lengths): per-token outputs, and pooled
    ones (the sum of each row's real tokens)."""

    def __init__(self, pooled: bool) -> None:
        self.pooled = pooled
        self.shapes: list[tuple[int, ...]] = []

    def to(self, _device: str) -> Doubled:
        return self

    def eval(self) -> Doubled:
        return self

    def __call__(self, padded: Any, lengths: Any) -> Any:
        import torch

        self.shapes.append(tuple(padded.shape))
        if not self.pooled:
            return padded * 2
        mask = torch.arange(padded.shape[1])[None, :] < lengths[:, None]
        return (padded * mask).sum(dim=1)


async def forward(model: Model, inputs: list[Any]) -> tuple[list[Any], Forwarder]:
    with ThreadPoolExecutor(1) as executor:
        fwd = Forwarder(model, model.bind("cpu"), executor)
        return await fwd.run_batches(inputs), fwd


@pytest.mark.parametrize("pooled", [False, True])
async def test_torch_model_gets_padded_and_lengths(pooled: bool) -> None:
    pytest.importorskip("torch")
    module = Doubled(pooled)
    spec = TensorSpec("int64", (None,), max_len=16, pad_value=-9)
    model = torch_model("dbl", lambda: module, spec, BatchPolicy(max_batch_size=2),
                        output_spec=None if pooled else TensorSpec("int64", (None,)))
    inputs = [np.arange(1, n + 1, dtype=np.int64) for n in (3, 9, 2, 4, 1, 16)]
    outputs, fwd = await forward(model, inputs)
    want = [int(x.sum()) if pooled else (x * 2).tolist() for x in inputs]
    assert [np.asarray(o).tolist() for o in outputs] == want
    # buckets 1, 2, 4 (two items: one pass), 16 (two items: one pass)
    assert sorted(module.shapes) == [(1, 1), (1, 2), (2, 4), (2, 16)]
    assert fwd.take_passes() == [2, 2, 1, 1]  # buckets in order of their first input
    assert fwd.take_padding() == (1 + 2 + 8 + 32, sum(len(x) for x in inputs))


async def test_a_per_token_output_of_the_wrong_length_breaks_the_contract() -> None:
    model = Model("short", fn=lambda batch: batch[0][:, :1], spec=TOKENS, stack=True,
                  output_spec=TensorSpec("int64", (None,)))
    outputs, _fwd = await forward(model, [np.arange(3), np.arange(4)])
    assert all("did not return 4 of them" in str(o) for o in outputs)


async def test_a_list_model_gets_same_bucket_groups_unpadded() -> None:
    seen: list[list[int]] = []

    def lengths(items: list[Any]) -> list[int]:
        seen.append([len(x) for x in items])
        return [len(x) for x in items]

    model = Model("lens", fn=lengths, spec=TOKENS)
    inputs = [np.zeros(n, np.int64) for n in (3, 100, 4, 70, 1)]
    outputs, fwd = await forward(model, inputs)
    assert outputs == [3, 100, 4, 70, 1]
    assert seen == [[3, 4], [100, 70], [1]]  # buckets in order of their first input
    assert fwd.take_padding() == (0, 0)  # the worker padded nothing


async def test_live_buckets_regroup_the_next_batches() -> None:
    seen: list[list[int]] = []

    def lengths(items: list[Any]) -> list[int]:
        seen.append([len(x) for x in items])
        return [len(x) for x in items]

    model = Model("lens", fn=lengths, spec=TOKENS)
    assert model.buckets == list(TOKENS.boundaries) == model.meta()["limits"]["buckets"]
    inputs = [np.zeros(n, np.int64) for n in (3, 100, 4, 70, 1)]
    with ThreadPoolExecutor(1) as executor:
        fwd = Forwarder(model, model.bind("cpu"), executor)
        model.apply_knobs({"buckets": [8, 128]})
        assert await fwd.run_batches(inputs) == [3, 100, 4, 70, 1]
        assert seen == [[3, 4, 1], [100, 70]]
        model.apply_knobs({"buckets": [512]})  # one bucket: one pass
        await fwd.run_batches(inputs)
        assert seen[2:] == [[3, 100, 4, 70, 1]]


def test_buckets_are_only_for_a_variable_length_model() -> None:
    fixed = Model("fixed", fn=list, spec=TensorSpec("float32", (4,)))
    assert fixed.buckets is None and "buckets" not in fixed.meta()["limits"]
    with pytest.raises(ConfigError, match="variable-length"):
        fixed.apply_knobs({"buckets": [8]})
    with pytest.raises(ConfigError, match="increase strictly"):
        Model("lens", fn=list, spec=TOKENS).apply_knobs(knobs.effective({}, {"buckets": [8, 8]}))


# --- padded to the longest item -------------------------------------------------------
@pytest.mark.parametrize("pooled", [False, True])
async def test_pad_to_longest_pads_each_pass_to_its_longest_sorted_by_length(
        pooled: bool) -> None:
    """Bucket 16's five items, in passes of 2: sorted by length (9, 10, 12, 15, 16),
    each pass padded to its own longest (10, 15, 16), not to 16; every output is the
    item's own, in claim order."""
    pytest.importorskip("torch")
    module = Doubled(pooled)
    spec = TensorSpec("int64", (None,), max_len=16, pad_value=-9)
    model = torch_model("dbl", lambda: module, spec,
                        BatchPolicy(max_batch_size=2, pad_to_longest=True),
                        output_spec=None if pooled else TensorSpec("int64", (None,)))
    inputs = [np.arange(1, n + 1, dtype=np.int64) for n in (12, 3, 16, 9, 15, 10)]
    outputs, fwd = await forward(model, inputs)
    want = [int(x.sum()) if pooled else (x * 2).tolist() for x in inputs]
    assert [np.asarray(o).tolist() for o in outputs] == want
    assert module.shapes == [(2, 10), (2, 15), (1, 16), (1, 3)]  # 12 came first
    assert fwd.take_passes() == [2, 2, 1, 1]
    assert fwd.take_padding() == (3 + 20 + 30 + 16, sum(len(x) for x in inputs))


async def test_pad_to_longest_is_a_live_knob_and_off_keeps_bucket_shapes() -> None:
    seen: list[tuple[int, ...]] = []

    def shapes(batch: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        padded, lengths = batch
        seen.append(padded.shape)
        return lengths

    model = Model("shapes", fn=shapes, spec=TOKENS, stack=True)
    assert model.meta()["defaults"]["pad_to_longest"] is False  # type: ignore[index]
    inputs = [np.ones(n, np.int64) for n in (70, 100)]
    with ThreadPoolExecutor(1) as executor:
        fwd = Forwarder(model, model.bind("cpu"), executor)
        assert await fwd.run_batches(inputs) == [70, 100]
        model.apply_knobs({"pad_to_longest": True})  # as the next heartbeat applies it
        assert await fwd.run_batches(inputs) == [70, 100]
    assert seen == [(2, 128), (2, 100)]
    with pytest.raises(InvalidKnob, match="pad_to_longest must be true or false"):
        knobs.check("pad_to_longest", "yes")


async def test_auto_batch_learns_a_shorter_pass_as_its_bucket_would_take(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``pad_to_longest``, a pass of items of 9 and 10 tokens (padded to 10) in
    bucket 16 that took 5 ms is learned as 5 x 16 / 9.5 ms (scaled to the bucket's
    length by the items' mean real length, its padding charged): the bucket's curve
    compares sizes, not which items each pass got; padded to the bucket, 5 ms."""
    model = Model("lens", fn=lambda batch: batch[1], spec=TOKENS, stack=True,
                  policy=BatchPolicy(max_batch_size=8, auto_batch=True, pad_to_longest=True))
    monkeypatch.setattr(Forwarder, "_measured_ms", lambda self, pass_ms: 5.0)
    with ThreadPoolExecutor(1) as executor:
        fwd = Forwarder(model, model.bind("cpu"), executor)
        await fwd.run_batches([np.ones(n, np.int64) for n in (9, 10)])
        model.policy = replace(model.policy, pad_to_longest=False)
        await fwd.run_batches([np.ones(n, np.int64) for n in (9, 10)])
    curve = fwd.sizer.curve(16)
    assert curve is not None and sorted(ms for _n, ms in curve.recent[2]) == [
        5.0, pytest.approx(5 * 16 / 9.5)]


def test_auto_batch_charges_a_pass_its_padding_when_padded_to_the_longest() -> None:
    """Bucket 256, pass time proportional to padded tokens: one item of 140 tokens
    (140 ms, no padding) against 8 items of 185 tokens on average padded to 250
    (2000 ms).  Per real token, the single item is 1.32x as fast: the learned figures
    say so (scaled by the mean real length; by the padded length both were 256 ms an
    item, a tie that the larger size would win)."""
    one = Forwarder._bucket_ms(140.0, 256, 140, 140.0)
    eight = Forwarder._bucket_ms(2000.0, 256, 250, 185.0)
    assert one == pytest.approx(256.0)
    assert eight / 8 == pytest.approx(2000 * 256 / 185 / 8)
    assert (eight / 8) / one == pytest.approx(250 / 185)
    assert Forwarder._bucket_ms(2000.0, 256, 256, 185.0) == 2000.0  # padded to the bucket
    assert Forwarder._bucket_ms(2000.0, None, None, None) == 2000.0  # a fixed shape
