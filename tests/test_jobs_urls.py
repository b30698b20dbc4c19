"""Bulk jobs with redbatch's queues on a Redis Cluster or behind Sentinel: RQ's queue
needs a plain Redis (``REDBATCH_JOBS_REDIS_URL``), the items go to ``REDIS_URL``."""

from __future__ import annotations

import math
import zlib

import pytest
import redis

from redbatch.cli import build_parser
from redbatch.errors import ConfigError
from redbatch.jobs import BulkOptions
from redbatch.jobs.cli import main as jobs_main
from redbatch.jobs.submit import submit_bulk
from redbatch.jobs.urls import JOBS_URL_ENV, portable, queues_url, rq_settings, with_password

CLUSTER = "redis+cluster://:s3cr3t@10.0.0.1:7000,10.0.0.2:7000"
PLAIN = "redis://10.0.0.9:6379/0"


def test_rq_takes_the_jobs_url_before_redis_url() -> None:
    assert rq_settings(None, {JOBS_URL_ENV: PLAIN, "REDIS_URL": CLUSTER}).url == PLAIN
    assert rq_settings(None, {"REDIS_URL": PLAIN}).url == PLAIN  # as before
    assert rq_settings("redis://other:6379/1", {JOBS_URL_ENV: PLAIN}).url == \
        "redis://other:6379/1"


def test_rq_refuses_a_cluster_or_sentinel_url() -> None:
    with pytest.raises(ConfigError, match=JOBS_URL_ENV) as caught:
        rq_settings(None, {"REDIS_URL": CLUSTER})
    assert "s3cr3t" not in str(caught.value)
    with pytest.raises(ConfigError, match="plain Redis"):
        rq_settings("redis+sentinel://s:26379/svc", {})


def test_items_go_to_redis_url_when_rq_has_its_own() -> None:
    env = {JOBS_URL_ENV: PLAIN, "REDIS_URL": CLUSTER}
    assert queues_url(None, None, env) == CLUSTER
    assert queues_url("redis://q:6379/0", None, env) == "redis://q:6379/0"
    assert queues_url(None, None, {"REDIS_URL": PLAIN}) is None  # RQ's own, as before
    # --redis-url names RQ's Redis: the items go to a cluster or sentinel REDIS_URL
    # (RQ cannot use it), else to RQ's own Redis, as before
    assert queues_url(None, PLAIN, {"REDIS_URL": CLUSTER}) == CLUSTER
    assert queues_url(None, PLAIN, {"REDIS_URL": "redis://other:6379/0"}) is None
    assert queues_url(None, PLAIN, {}) is None


def test_jobs_on_a_cluster_url_alone_exit_2_naming_the_setting(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("REDIS_URL", CLUSTER)
    monkeypatch.delenv(JOBS_URL_ENV, raising=False)
    assert jobs_main(build_parser().parse_args(["jobs", "status", "some-job"])) == 2
    err = capsys.readouterr().err
    assert JOBS_URL_ENV in err and "s3cr3t" not in err


@pytest.mark.parametrize(("url", "stored"), [
    (CLUSTER, "redis+cluster://10.0.0.1:7000,10.0.0.2:7000"),
    ("redis+sentinel://rb:s3cr3t@s:26379/svc?ssl=1&sentinel_password=s3cr3t&sentinel_ssl=0",
     "redis+sentinel://rb@s:26379/svc?ssl=1&sentinel_ssl=0"),
    ("unix:///tmp/r.sock?db=2&password=s3cr3t", "unix:///tmp/r.sock?db=2"),
    (PLAIN, PLAIN),
])
def test_a_job_stores_its_queues_url_without_passwords(url: str, stored: str) -> None:
    assert portable(url) == stored
    assert with_password(stored, {"REDIS_URL": url}) == url  # the RQ worker's own
    assert with_password(stored, {"REDIS_URL": "redis://elsewhere:6379/0"}) == stored
    assert with_password(stored, {}) == stored


def test_a_submitted_job_holds_no_password(raw_redis: redis.Redis) -> None:
    job = submit_bulk(raw_redis, "inc", [1, 2], redis_url=CLUSTER, queue="rb-test-pw")
    try:
        assert job.kwargs["redis_url"] == portable(CLUSTER)
        call = zlib.decompress(raw_redis.hget(job.key, "data") or b"")  # RQ's stored call
        assert b"10.0.0.1:7000" in call and b"s3cr3t" not in call
        assert all(b"s3cr3t" not in v for v in raw_redis.hvals(job.key))
    finally:
        job.delete()


@pytest.mark.parametrize("url", ["redis://:hunter?2@127.0.0.1:6393/0",
                                 "redis://:se/cret@127.0.0.1:6393/0",
                                 "redis+sentinel://:pw@h1:26379"])
def test_a_queues_url_that_does_not_parse_is_refused_before_it_is_stored(url: str) -> None:
    """A raw '/' or '?' cuts a password short: stored, it would be in clear text (and a
    sentinel URL without its service raised an AssertionError)."""
    with pytest.raises(ConfigError) as caught:
        queues_url(url, None, {})
    with pytest.raises(ConfigError):
        queues_url(None, None, {"REDIS_URL": url, JOBS_URL_ENV: PLAIN})
    with pytest.raises(ConfigError):
        portable(url)
    assert "hunter" not in str(caught.value) and "cret" not in str(caught.value)


@pytest.mark.parametrize("flags", [["--result-ttl", "0"], ["--job-timeout", "-5"],
                                   ["--retries", "-3"], ["--poll-s", "1e10"],
                                   ["--poll-s", "nan"]])
def test_bad_job_flags_exit_2(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["jobs", "submit", "m", "[1]", *flags])
    assert caught.value.code == 2


@pytest.mark.parametrize("options", [{"max_wait_s": math.nan}, {"wait_workers_s": math.nan},
                                     {"max_wait_s": math.inf}, {"priority": -7},
                                     {"priority": 17}])
def test_bulk_options_refuse_waits_without_end_and_levels_out_of_range(
        options: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        BulkOptions(**options)  # type: ignore[arg-type]



def test_a_source_url_that_does_not_parse_is_refused_without_its_password() -> None:
    from redbatch.jobs.sources import BadSource, check_source

    with pytest.raises(BadSource, match="does not parse") as err:  # (NFKC: urlsplit refuses)
        check_source("https://alice:s3cret\u2100@data.example.com/in.jsonl")
    assert "s3cret" not in str(err.value)
