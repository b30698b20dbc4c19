"""The values a model takes (``TensorSpec(min_value=..., max_value=...)``, token ids
below a vocabulary size): a value out of range is invalid input, refused with a message
that names the field and the value (v1 422, v2 400), before it is enqueued; an entry
that reaches the queue some other way is refused by the worker, uncomputed, and its
batch-mates are served.  A padded position (outside the mask) is not checked."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import redis

from redbatch import TensorSpec, demo, protocol
from redbatch.api.directory import ModelInfo
from redbatch.bench.textcls import VOCAB
from redbatch.errors import ConfigError, InvalidPayload
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from tests.conftest import wait_live
from tests.test_gateway import error_code, gateway
from tests.test_hostile_worker import entry
from tests.test_masks import masked_call
from tests.test_reliability import read_reply
from tests.test_v2 import v2_error

IDS = TensorSpec("int64", (None,), max_len=16, mask="attention_mask", min_value=0,
                 max_value=99)
POLICY = BatchPolicy(max_batch_size=8, batch_wait_timeout_s=0.05)


# --- the spec -------------------------------------------------------------------------
def test_values_in_range_pass_and_others_are_refused_naming_field_and_value() -> None:
    assert IDS.check([0, 5, 99], "input_ids").tolist() == [0, 5, 99]
    with pytest.raises(InvalidPayload, match=r"^input_ids holds 100, outside the values "
                                             r"this model takes \(0\.\.99: min_value"):
        IDS.check([1, 100, 2], "input_ids")
    with pytest.raises(InvalidPayload, match="holds -1"):
        IDS.check(np.array([3, -1], np.int64))
    with pytest.raises(InvalidPayload, match="holds 200"):
        IDS.check_rows(np.array([[1, 2], [3, 200]], np.int64))
    wide = TensorSpec("float32", (None,), max_len=4, min_value=-2**70, max_value=1e300)
    values = [-1e20, 1e30]  # within bounds past float32's range: no overflow warning
    assert wide.check(values).tolist() == np.array(values, np.float32).tolist()
    with pytest.raises(InvalidPayload, match=r"holds -1e\+22, .*\(-1180591620717411303424\.\."):
        wide.check([-1e22])
    one_sided = TensorSpec("float32", (2,), max_value=1.5)
    assert one_sided.check([-1e9, 1.5]).tolist() == [-1e9, 1.5]
    with pytest.raises(InvalidPayload, match=r"holds 2, .*\(\.\.1\.5:"):
        one_sided.check([0.0, 2.0])


def test_a_padded_position_is_not_checked_a_real_one_is() -> None:
    assert IDS.check_masked([-1, 7, 8, -1], [0, 1, 1, 0]).tolist() == [7, 8]
    with pytest.raises(InvalidPayload, match="holds 500"):
        IDS.check_masked([500, 7, 0], [1, 1, 0])


@pytest.mark.parametrize("bounds", [
    {"min_value": 5, "max_value": 4}, {"min_value": float("nan")},
    {"max_value": float("inf")}, {"min_value": "0"}, {"max_value": True},
    {"max_value": 10**400}])
def test_bad_bounds_are_refused(bounds: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"min_value|max_value"):
        TensorSpec("int64", (None,), max_len=8, **bounds)


def test_bounds_are_published_and_read_back_and_absent_when_unset() -> None:
    published = IDS.to_json()
    assert (published["min_value"], published["max_value"]) == (0, 99)
    back = ModelInfo.from_meta({"name": "m", "spec": published}).spec
    assert back is not None and (back.min_value, back.max_value) == (0, 99)
    plain = replace(IDS, min_value=None, max_value=None).to_json()
    assert "min_value" not in plain and "max_value" not in plain


# --- the gateway and the worker -------------------------------------------------------
def counted(calls: list[int]) -> Model:
    """The sum of each request's real ids, counting the items it computes."""
    def sums(batch: Any) -> list[int]:
        padded, lengths = batch
        calls.extend(int(n) for n in lengths)
        return [int(row[:n].sum()) for row, n in zip(padded, lengths, strict=True)]
    return Model("vsum", fn=sums, policy=POLICY, spec=IDS, input_name="input_ids",
                 output_name="total", stack=True, inline=True)


async def test_v1_and_v2_refuse_an_id_out_of_range_before_computing_it(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    calls: list[int] = []
    start_worker([counted(calls)])
    async with gateway(redis_url) as http:
        await wait_live(redis_url, "vsum")
        ok = await http.post("/v1/models/vsum/predict", json={"input_ids": [1, 2, 99]})
        assert ok.status_code == 200 and ok.json()["total"] == 102, ok.text
        calls.clear()
        v1 = await http.post("/v1/models/vsum/predict", json={"input_ids": [1, 8192]})
        assert v1.status_code == 422 and error_code(v1) == "invalid_payload"
        assert "input_ids holds 8192" in v1.json()["error"]["message"], v1.text
        padded = await http.post("/v1/models/vsum/predict",  # its pad id is not a value
                                 json={"input_ids": [4, 5, -1], "attention_mask": [1, 1, 0]})
        assert padded.status_code == 200 and padded.json()["total"] == 9, padded.text
        body = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [2, 2],
                            "data": [1, 2, 3, -7]}]}
        v2 = await http.post("/v2/models/vsum/infer", json=body)
        assert v2.status_code == 400 and "input 'input_ids' holds -7" in v2_error(v2)
        content, headers = masked_call([[1, 2, 0], [300, 5, 6]], [[1, 1, 0], [1, 1, 1]],
                                       binary=True)
        masked = await http.post("/v2/models/vsum/infer", content=content, headers=headers)
        assert masked.status_code == 400, masked.text
        assert "row 1: input 'input_ids' holds 300" in v2_error(masked)
        assert calls == [2]  # the padded v1 call alone was computed


async def test_an_entry_out_of_range_on_the_queue_fails_alone_uncomputed(
        raw_redis: redis.Redis, start_worker: Callable[..., Worker]) -> None:
    """Two entries pushed as a foreign client would, bypassing the gateway's check: the
    one holding an id out of range is answered ``invalid_payload`` and never reaches
    the model; the other is computed."""
    calls: list[int] = []
    reply_to = protocol.reply_key("vsum", "foreign")
    bad_id, bad = entry([3, 1000], reply_to, model="vsum")
    good_id, good = entry([3, 4], reply_to, model="vsum")
    raw_redis.rpush(protocol.queue_key("vsum"), bad, good)
    start_worker([counted(calls)])
    first = await asyncio.to_thread(read_reply, raw_redis, reply_to)
    second = await asyncio.to_thread(read_reply, raw_redis, reply_to)
    replies = {r.id: r for r in (first, second)}
    assert replies[bad_id].error_code == "invalid_payload"
    assert "holds 1000" in str(replies[bad_id].error_message)
    assert replies[good_id].payload == 7
    assert calls == [2]


def test_the_demo_text_classifier_takes_the_ids_of_its_vocabulary() -> None:
    textcls = next(m for m in demo.models() if m.name == "textcls")
    assert isinstance(textcls, Model) and textcls.spec is not None
    assert (textcls.spec.min_value, textcls.spec.max_value) == (0, VOCAB - 1)
    textcls.spec.check([0, VOCAB - 1])
    with pytest.raises(InvalidPayload, match=f"holds {VOCAB}"):
        textcls.spec.check([VOCAB])
