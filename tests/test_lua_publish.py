"""The PUBLISH script against a real Redis: replies grouped by reply list (one RPUSH and
at most one EXPIRE per list, kept until the furthest deadline of its replies), each
request answered at most once, a refused list failing its own requests alone, and the
ack only while the in-flight head holds the batch."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
import redis

from redbatch import lua, protocol
from redbatch.lean import script_sha

MODEL = "m"
INFLIGHT = protocol.inflight_key(MODEL, "w1")
DEAD = protocol.dead_letter_key(MODEL)
A, B = protocol.reply_key(MODEL, "a"), protocol.reply_key(MODEL, "b")
pytestmark = pytest.mark.timeout(30)


def publish(raw: redis.Redis, replies: list[tuple[str, str, bytes]], batch: list[bytes],
            digest: str | None = None, marker_ttl_ms: int = 60_000, by_entries: bool = False,
            dead: tuple[bytes, ...] = ()) -> list[object]:
    """PUBLISH ``replies`` (request id, reply list, data) and ``dead`` letters, and ack
    ``batch`` (checked by its SHA-1, or ``by_entries``: by the entries themselves); each
    request's marker TTL (its deadline) is ``marker_ttl_ms``."""
    keys: list[str] = [INFLIGHT, DEAD]
    check: list[object] = [protocol.ACK_BY_ENTRIES, *batch] if by_entries else [
        digest or hashlib.sha1(b"".join(batch)).hexdigest()]
    argv: list[object] = [len(batch), protocol.REPLY_TTL_S, *check, 3600, len(dead), *dead]
    for request_id, reply_to, data in replies:
        keys += [protocol.request_key(MODEL, request_id), reply_to]
        argv += [marker_ttl_ms, data]
    raw.script_load(lua.PUBLISH)
    return list(raw.evalsha(script_sha(lua.PUBLISH), len(keys), *keys, *argv))


def two_clients(raw: redis.Redis) -> list[tuple[str, str, bytes]]:
    """Four requests of two clients, interleaved in one batch, all queued (marker 'q')."""
    replies = [("r1", A, b"a1"), ("r2", B, b"b1"), ("r3", A, b"a2"), ("r4", B, b"b2")]
    for request_id, _to, _data in replies:
        raw.set(protocol.request_key(MODEL, request_id), "q")
    return replies


def test_replies_are_grouped_by_reply_list(raw_redis: redis.Redis) -> None:
    raw_redis.rpush(INFLIGHT, b"e1", b"e2", b"next")
    replies = two_clients(raw_redis)
    raw_redis.config_resetstat()
    assert publish(raw_redis, replies, [b"e1", b"e2"]) == [1, 4]
    assert raw_redis.lrange(A, 0, -1) == [b"a1", b"a2"]  # each list in batch order
    assert raw_redis.lrange(B, 0, -1) == [b"b1", b"b2"]
    assert 0 < raw_redis.ttl(A) <= protocol.REPLY_TTL_S and raw_redis.ttl(B) > 0
    stats = raw_redis.info("commandstats")
    assert stats["cmdstat_rpush"]["calls"] == 2  # one RPUSH per list
    assert stats["cmdstat_expire"]["calls"] == 2  # a new list: its EXPIRE NX alone
    assert raw_redis.lrange(INFLIGHT, 0, -1) == [b"next"]  # the batch acked, no more
    assert {raw_redis.get(protocol.request_key(MODEL, r)) for r, _t, _d in replies} == {b"d"}


def test_a_reply_list_of_another_type_refuses_only_its_own_requests(
        raw_redis: redis.Redis) -> None:
    raw_redis.rpush(INFLIGHT, b"e1")
    raw_redis.set(B, "not a list")
    assert publish(raw_redis, two_clients(raw_redis), [b"e1"]) == [1, 2, 2, 4]
    assert raw_redis.lrange(A, 0, -1) == [b"a1", b"a2"]
    assert raw_redis.get(B) == b"not a list"
    assert raw_redis.llen(INFLIGHT) == 0  # acked all the same: the caller dead-letters


def test_a_marker_of_another_type_refuses_only_its_request(raw_redis: redis.Redis) -> None:
    replies = two_clients(raw_redis)
    raw_redis.delete(protocol.request_key(MODEL, "r3"))
    raw_redis.rpush(protocol.request_key(MODEL, "r3"), "a list")
    assert publish(raw_redis, replies, []) == [1, 3, 3]
    assert raw_redis.lrange(A, 0, -1) == [b"a1"]
    assert raw_redis.lrange(B, 0, -1) == [b"b1", b"b2"]


def test_a_request_answered_before_gets_no_second_reply(raw_redis: redis.Redis) -> None:
    replies = two_clients(raw_redis)
    raw_redis.set(protocol.request_key(MODEL, "r2"), "d")
    raw_redis.set(protocol.request_key(MODEL, "r4"), "d")
    assert publish(raw_redis, replies, []) == [1, 2]
    assert raw_redis.lrange(A, 0, -1) == [b"a1", b"a2"]
    assert not raw_redis.exists(B)  # nothing pushed, no TTL set on a list nobody made


def test_a_changed_inflight_head_is_not_acked(raw_redis: redis.Redis) -> None:
    """A reaper took the list over and this worker claimed others since: the replies
    still go out (at most once), nothing is trimmed."""
    raw_redis.rpush(INFLIGHT, b"other", b"e1")
    assert publish(raw_redis, two_clients(raw_redis), [b"e1", b"e2"]) == [0, 4]
    assert raw_redis.lrange(INFLIGHT, 0, -1) == [b"other", b"e1"]


def lpos_denials(raw: redis.Redis) -> int:
    """The LPOS calls that Redis refused a user, as ``ACL LOG`` counts them."""
    return sum(int(e["count"]) for e in raw.acl_log() if e["object"] == "lpos")


@pytest.fixture(params=["lpos", "no_lpos"])
def acker(request: pytest.FixtureRequest, raw_redis: redis.Redis) -> Iterator[redis.Redis]:
    """A client that acks by entries: Redis compares them in place (LPOS), or, as a user
    who lost the right to run LPOS (refused: ``ACL LOG`` says so), through a copy."""
    raw_redis.acl_log_reset()
    if request.param == "lpos":
        yield raw_redis
        assert lpos_denials(raw_redis) == 0
        return
    raw_redis.acl_setuser("nolpos", enabled=True, passwords=["+pw"], keys=["*"],
                          commands=["+@all", "-lpos"], reset=True)
    kwargs = raw_redis.connection_pool.connection_kwargs
    client = redis.Redis(host=kwargs["host"], port=kwargs["port"], username="nolpos",
                         password="pw")
    yield client
    client.close()
    raw_redis.acl_deluser("nolpos")
    assert lpos_denials(raw_redis) > 0  # the copy was compared: LPOS really was refused


@pytest.mark.parametrize("inflight", [
    [b"other", b"e1", b"e2"],  # this worker claimed another since the reap
    [b"e1"],  # a reaper took e2 (it had come back)
    [b"e2", b"e1"],  # the same entries, in another order
    [b"e1", b"e1"],  # a copy of e1 (a plain RPUSH pushed it twice) where e2 was
    [],  # the list is gone
])
def test_an_ack_by_entries_refuses_any_other_head(raw_redis: redis.Redis, acker: redis.Redis,
                                                   inflight: list[bytes]) -> None:
    if inflight:
        raw_redis.rpush(INFLIGHT, *inflight)
    assert publish(acker, two_clients(raw_redis), [b"e1", b"e2"], by_entries=True) == [0, 4]
    assert raw_redis.lrange(INFLIGHT, 0, -1) == inflight  # replies out, nothing trimmed
    assert raw_redis.lrange(A, 0, -1) == [b"a1", b"a2"]


@pytest.mark.parametrize("batch", [[b"e1", b"e2"], [b"e1", b"e1", b"e2", b"e1"]])
def test_an_ack_by_entries_trims_its_batch_alone(raw_redis: redis.Redis, acker: redis.Redis,
                                                  batch: list[bytes]) -> None:
    """Copies of one entry in a batch (a request pushed twice) match copy by copy; the
    replies and dead letters follow the entries in ARGV."""
    raw_redis.rpush(INFLIGHT, *batch, b"e1", b"next")
    raw_redis.rpush(DEAD, b"old")
    assert publish(acker, two_clients(raw_redis), batch, by_entries=True,
                   dead=(b"dl",)) == [1, 4]
    assert raw_redis.lrange(INFLIGHT, 0, -1) == [b"e1", b"next"]
    assert raw_redis.lrange(B, 0, -1) == [b"b1", b"b2"]
    assert raw_redis.lrange(DEAD, 0, -1) == [b"old", b"dl"]


def test_a_refused_ack_by_entries_writes_no_dead_letter(raw_redis: redis.Redis,
                                                        acker: redis.Redis) -> None:
    raw_redis.rpush(INFLIGHT, b"other", b"e1")
    assert publish(acker, [], [b"e1"], by_entries=True, dead=(b"dl",)) == [0, 0]
    assert not raw_redis.exists(DEAD)  # the reaper dead-letters: it took the list over


def test_an_ack_by_entries_raises_any_other_error(raw_redis: redis.Redis) -> None:
    """Only a refusal (no right to run LPOS) falls back to the copy: a WRONGTYPE in-flight
    key fails the script before it writes anything."""
    raw_redis.set(INFLIGHT, b"not a list")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        publish(raw_redis, two_clients(raw_redis), [b"e1"], by_entries=True, dead=(b"dl",))
    assert not raw_redis.exists(A, B, DEAD)
    assert raw_redis.get(protocol.request_key(MODEL, "r1")) == b"q"


def test_a_thousand_replies_to_one_list(raw_redis: redis.Redis) -> None:
    """Over Lua's unpack limit: the replies of one list go in slices, in order."""
    replies = [(f"r{i}", A, str(i).encode()) for i in range(2500)]
    assert publish(raw_redis, replies, []) == [1, 2500]
    assert raw_redis.lrange(A, 0, -1) == [str(i).encode() for i in range(2500)]


def test_a_reply_list_lives_120_s_past_its_last_short_reply(raw_redis: redis.Redis) -> None:
    """Replies whose deadlines are near: the list expires ``REPLY_TTL_S`` (120 s) after
    the last one, as a foreign caller's contract says."""
    publish(raw_redis, two_clients(raw_redis), [], marker_ttl_ms=60_000)
    assert 110 <= raw_redis.ttl(A) <= 120 and 110 <= raw_redis.ttl(B) <= 120


def test_a_reply_list_outlives_its_furthest_deadline(raw_redis: redis.Redis) -> None:
    """A reply of a far deadline (a stage's outbox holding a hand-off record) keeps its
    list until then; a later batch of near deadlines does not shorten it."""
    publish(raw_redis, [("far", A, b"f")], [], marker_ttl_ms=500_400)
    assert 490 <= raw_redis.ttl(A) <= 501
    publish(raw_redis, [("near", A, b"n")], [], marker_ttl_ms=5_000)
    assert 490 <= raw_redis.ttl(A) <= 501
    assert raw_redis.lrange(A, 0, -1) == [b"f", b"n"]


def test_a_reply_list_with_a_ttl_is_kept_longer_for_a_far_reply(raw_redis: redis.Redis
                                                               ) -> None:
    """A list that has its TTL already (EXPIRE NX sets nothing) is kept as long as a new
    reply of a further deadline (EXPIRE GT): one EXPIRE more for such a list."""
    publish(raw_redis, [("near", A, b"n")], [], marker_ttl_ms=5_000)
    assert 110 <= raw_redis.ttl(A) <= 120
    raw_redis.config_resetstat()
    publish(raw_redis, [("far", A, b"f")], [], marker_ttl_ms=500_400)
    assert 490 <= raw_redis.ttl(A) <= 501
    assert raw_redis.info("commandstats")["cmdstat_expire"]["calls"] == 2


@pytest.mark.parametrize(("error", "falls_back"), [
    ("NOPERM User nolpos has no permissions to run the 'lpos' command", True),  # 7.2+
    ("ERR The user executing the script can't run this command or subcommand", True),  # 7.0
    ("ERR Unknown Redis command called from script", True),
    ("WRONGTYPE Operation against a key holding the wrong kind of value", False),
    ("ERR RANK can't be zero: use 1 to start from the first match", False),  # a bad argument
])
def test_only_a_refused_lpos_falls_back_to_the_copy(raw_redis: redis.Redis, error: str,
                                                    falls_back: bool) -> None:
    script = lua._HELPERS + "return denied(ARGV[1]) and 1 or 0"
    assert raw_redis.eval(script, 0, error) == int(falls_back)
