"""redis+cluster:// and redis+sentinel:// URLs: parsed and checked at start, passwords
never shown; plain URLs keep their single-node client."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from redbatch.config import RedisSettings, Topology, redact_url
from redbatch.embedded import free_port
from redbatch.errors import ConfigError, RedisUnavailable
from redbatch.redis_conn import async_client, translated
from redbatch.url_options import NodeOptions

SECRET = "Qx7Kp9zz"


@pytest.mark.parametrize(("url", "expected"), [
    ("redis+cluster://10.0.0.1:7000", Topology("cluster", (("10.0.0.1", 7000),))),
    ("redis+cluster://a:7000,b:7001,c", Topology(
        "cluster", (("a", 7000), ("b", 7001), ("c", 6379)))),
    ("redis+cluster://[::1]:7000/0", Topology("cluster", (("::1", 7000),))),
    ("redis+sentinel://s1:26379,s2:26380/mymaster/2", Topology(
        "sentinel", (("s1", 26379), ("s2", 26380)), service="mymaster", db=2)),
    ("redis+sentinel://s1/mymaster", Topology("sentinel", (("s1", 26379),),
                                              service="mymaster")),
])
def test_several_node_urls_name_their_seeds(url: str, expected: Topology) -> None:
    assert RedisSettings(url).topology == expected


def test_options_give_tls_and_the_sentinels_credentials() -> None:
    nodes = RedisSettings("redis+cluster://h:7000?ssl=true&ssl_ca_certs=/etc/ca.pem"
                          "&ssl_cert_reqs=Required").topology
    assert nodes is not None
    assert nodes.options == NodeOptions((("ssl", True), ("ssl_ca_certs", "/etc/ca.pem"),
                                         ("ssl_cert_reqs", "required")), sentinel_tls=True)
    nodes = RedisSettings(f"redis+sentinel://:data@s:26379/svc?sentinel_password={SECRET}"
                          "&sentinel_username=watch").topology
    assert nodes is not None and nodes.options.tls == () and nodes.password == "data"
    assert nodes.options.sentinel_kwargs() == {"username": "watch", "password": SECRET}
    assert SECRET not in repr(nodes)
    tls_data_only = RedisSettings("redis+sentinel://s/svc?ssl=on&sentinel_ssl=off").topology
    assert tls_data_only is not None and tls_data_only.options.sentinel_kwargs() == {}


def test_credentials_are_percent_decoded_for_the_data_nodes() -> None:
    nodes = RedisSettings("redis+cluster://rb:p%40ss%2F1@h:7000").topology
    assert nodes is not None and (nodes.username, nodes.password) == ("rb", "p@ss/1")
    nodes = RedisSettings(f"redis+sentinel://:{SECRET}@h:26379/svc").topology
    assert nodes is not None and (nodes.username, nodes.password) == (None, SECRET)


@pytest.mark.parametrize("url", ["redis://h:6379/0", "rediss://h:6380/0",
                                 "unix:///tmp/r.sock?db=1"])
def test_plain_urls_have_no_topology(url: str) -> None:
    assert RedisSettings(url).topology is None


@pytest.mark.parametrize(("url", "problem"), [
    ("redis+cluster://", "no seed node"),
    (f"redis+cluster://u:{SECRET}@", "no seed node"),
    ("redis+cluster://h:7000,,h:7001", "has no host"),
    (f"redis+cluster://:{SECRET}@:7000", "has no host"),
    ("redis+cluster://h:70x0", "port is not a number"),
    ("redis+cluster://h:0", "port is not a number"),
    ("redis+cluster://h:7000,h:99999", "port is not a number"),
    ("redis+cluster://h:7000/3", "database 0 only"),
    ("redis+cluster://h:7000?ssl=maybe", "option 'ssl' is not true or false"),
    ("redis+cluster://h:7000?ssl_ca_certs=ca.pem", "option 'ssl_ca_certs' needs ssl=true"),
    ("redis+cluster://h:7000?ssl=1&ssl_cert_reqs=lax", "'ssl_cert_reqs' is not none, opt"),
    (f"redis+cluster://h:7000?sentinel_password={SECRET}", "'sentinel_password' is not one"),
    ("redis+sentinel://h:26379/svc?sentinel_ssl=2", "option 'sentinel_ssl' is not true"),
    ("redis+sentinel://h:26379/svc?timeout=3", "option 'timeout' is not one of"),
    ("redis+sentinel://h:26379", "no service name"),
    ("redis+sentinel://h:26379/", "no service name"),
    ("redis+sentinel://h:26379/svc/zero", "no service name"),
    (f"redis+sentinel://:{SECRET[:3]}/{SECRET[3:]}@h:26379/svc", "'@' after its host"),
    ("redis+sentinels://h:26379/svc", "must start with"),
])
def test_bad_several_node_urls_fail_loudly_quoting_nothing(url: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as caught:
        RedisSettings(url)
    assert SECRET[3:] not in str(caught.value) and "h:" not in str(caught.value)


@pytest.mark.parametrize(("url", "safe"), [
    (f"redis+cluster://rb:{SECRET}@a:7000,b:7001",
     "redis+cluster://rb:***@a:7000,b:7001"),
    (f"redis+sentinel://:{SECRET}@s1:26379,s2:26379/svc/1",
     "redis+sentinel://:***@s1:26379,s2:26379/svc/1"),
    (f"redis+sentinel://s1/svc?ssl=1&sentinel_password={SECRET}&sentinel_ssl=0",
     "redis+sentinel://s1/svc?ssl=1&sentinel_password=***&sentinel_ssl=0"),
])
def test_a_password_never_shows(url: str, safe: str) -> None:
    settings = RedisSettings(url)
    assert settings.safe_url == safe == redact_url(url)
    assert SECRET not in repr(settings) and SECRET not in repr(settings.topology)


@pytest.mark.parametrize("template", ["redis+cluster://127.0.0.1:{port}",
                                      "redis+sentinel://127.0.0.1:{port}/svc"])
async def test_no_node_answering_is_redis_unavailable(template: str) -> None:
    settings = RedisSettings(template.format(port=free_port()), connect_timeout_s=0.5)
    client = async_client(settings)
    try:
        with pytest.raises(RedisUnavailable):
            async with asyncio.timeout(5), translated(settings):
                await client.llen("rb:{m}:queue")
    finally:
        await client.aclose()


async def test_close_all_closes_every_client_when_one_fails() -> None:
    """A worker's clients are closed together: one that fails to close (its pool, or a
    Sentinel primary's) leaves none of the others open, and its error still shows."""
    from redbatch.redis_conn import close_all

    closed: list[str] = []

    class Fake:
        def __init__(self, name: str, fails: bool = False) -> None:
            self.name, self.fails = name, fails

        async def aclose(self) -> None:
            closed.append(self.name)
            if self.fails:
                raise ConnectionError(f"{self.name} would not close")

    with pytest.raises(ConnectionError, match="a would not close"):
        await close_all(Fake("a", fails=True), Fake("b"), Fake("c"))
    assert sorted(closed) == ["a", "b", "c"]
    await close_all()  # nothing to close


def test_an_unavailable_message_leaves_out_redis_pys_client_repr() -> None:
    from redbatch.redis_conn import unavailable

    settings = RedisSettings("redis+sentinel://127.0.0.1:26379/svc")
    raised = Exception("No master found for 'svc' : <redis.asyncio.client.Redis("
                       f"<ConnectionPool({'x' * 1000})>)>")
    message = str(unavailable(settings, raised))
    assert message.endswith("unavailable: Exception: No master found for 'svc'"), message
    assert len(str(unavailable(settings, Exception("y" * 5000)))) < 400


def test_a_refused_command_is_not_called_redis_unavailable() -> None:
    """``redbatch config m`` on a key of another type said "redis ... unavailable"."""
    import redis

    from redbatch.redis_conn import unavailable

    settings = RedisSettings("redis://127.0.0.1:6379/0")
    wrong = redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind")
    assert "refused a command: ResponseError: WRONGTYPE" in str(unavailable(settings, wrong))
    assert "unavailable: ConnectionError" in str(
        unavailable(settings, redis.ConnectionError("refused")))


async def test_lookups_at_once_never_drop_a_sentinel_from_the_list() -> None:
    """redis-py's ``discover_master`` swapped by an index read before its ``await``:
    two lookups at once (every connection's, after a failover) wrote one sentinel
    twice and dropped another, never asked again nor closed (an open link's
    ``ResourceWarning``, seen in the Sentinel failover ledger)."""
    import redis

    from redbatch.redis_conn import ShieldedSentinel

    gate = asyncio.Event()
    closed: list[str] = []

    class Link:
        def __init__(self, name: str, up: bool) -> None:
            self.name, self.up = name, up

        async def sentinel_masters(self) -> dict[str, Any]:
            if not self.up:
                raise redis.ConnectionError("down")
            await gate.wait()
            return {"svc": {"is_master": True, "is_sdown": False, "is_odown": False,
                            "num-other-sentinels": 2, "ip": "10.0.0.9", "port": 6379}}

        async def aclose(self) -> None:
            closed.append(self.name)

    sentinel = ShieldedSentinel([("127.0.0.1", 1), ("127.0.0.1", 2), ("127.0.0.1", 3)])
    links = [Link("s0", False), Link("s1", False), Link("s2", True)]
    sentinel.sentinels[:] = links
    sentinel._links = list(links)
    lookups = [asyncio.create_task(sentinel.discover_master("svc")) for _ in range(2)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*lookups) == [("10.0.0.9", 6379)] * 2
    assert sorted(link.name for link in sentinel.sentinels) == ["s0", "s1", "s2"]
    assert sentinel.sentinels[0].name == "s2"
    await sentinel.aclose()
    assert sorted(closed) == ["s0", "s1", "s2"]
