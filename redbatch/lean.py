"""A lean command path for the hot loops (claim, publish, enqueue, reply pop).

``Redis.execute_command`` wraps every command in a pool checkout, a retry wrapper, a
timeout context and a health check; on this project's 2-vCPU machines that costs
about 100 µs of CPU and 60 µs of latency per command, and a lone request crosses
four such commands.  ``LeanLink`` keeps ONE connection of the client's pool for
itself and sends commands straight on it: the connection, its settings (URL, auth,
TLS, db, socket timeout) and its reply parser and errors are still redis-py's.

* Commands are written in the caller's task (redis-py writes under ``wait_for``, in
  a task of its own: one more loop iteration per command).
* The socket timeout still bounds every read (it is longer than any blocking pop)
  and every write the socket does not take at once.
* Any error but a Redis error reply, or a cancel, drops the connection (its state
  is unknown); the next call reconnects.  Nothing is ever re-sent.
* While one command is in flight, another caller goes through the full client
  instead of queueing behind it (whose response callbacks leave the replies of
  EVALSHA, BLMOVE, BLMPOP and LLEN as they are).  Callers whose commands must stay on this one
  connection (a blocking pop that ``CLIENT UNBLOCK`` ends) are sequential.
* The connection goes back with the client: ``aclose`` disconnects the pool's
  connections, in use or not.

A Redis Cluster client has no single pool: ``LeanLink(cluster_client)`` is a
``ClusterLink``, which holds one connection to the primary owning the slot of the
call's keys (a model's keys share one slot) and leaves redirections and broken
connections to the cluster client.  The choice is made once, when the link is made.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import (
    AskError,
    MovedError,
    NoScriptError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from redbatch.redis_conn import NODE_ERRORS, remap_after


class LeanLink:
    """Commands on one held connection of ``client``'s pool (see the module doc)."""

    def __new__(cls, client: aioredis.Redis) -> LeanLink:
        kind = ClusterLink if cls is LeanLink and isinstance(client, RedisCluster) else cls
        return super().__new__(kind)

    def __init__(self, client: aioredis.Redis) -> None:
        self._client: Any = client  # (its stubs leave these calls untyped)
        self._conn: AbstractConnection | None = None
        self._busy = False

    async def execute(self, *args: Any) -> Any:
        """One command's parsed reply (no response callbacks: bytes, ints, lists)."""
        if self._busy:
            return await self._client.execute_command(*args)
        return (await self.pipeline(args))[0]

    async def pipeline(self, *commands: tuple[Any, ...]) -> list[Any]:
        """Several commands in one write, their replies in order (no transaction):
        a blocking pop followed by a read runs the read once the pop is served.  The
        first error reply is raised."""
        return await self._pipeline(commands, checked=True)

    async def pipeline_replies(self, *commands: tuple[Any, ...]) -> list[Any]:
        """As ``pipeline``, with error replies in place (``ResponseError`` values)
        instead of raised: the caller tells which command's error matters."""
        return await self._pipeline(commands, checked=False)

    async def _pipeline(self, commands: tuple[tuple[Any, ...], ...], checked: bool
                        ) -> list[Any]:
        if self._busy:  # on one connection of the pool, all in one write as well
            pipe: Any = self._client.pipeline(transaction=False)
            async with pipe:
                for command in commands:
                    pipe.execute_command(*command)
                return list(await pipe.execute(raise_on_error=checked))
        self._busy = True
        try:
            return await self._send_many(commands, checked)
        finally:
            self._busy = False

    async def script(self, source: str, keys: list[Any], args: list[Any]) -> Any:
        """EVALSHA of ``source``, loading it once if Redis lost it (a restart, a flush)."""
        command = ("EVALSHA", script_sha(source), len(keys), *keys, *args)
        return (await self.pipeline_loading(source, command))[0]

    async def pipeline_loading(self, source: str, *commands: tuple[Any, ...]) -> list[Any]:
        """``pipeline``, once more after loading ``source`` if Redis lost it (a
        restart, a flush, a promoted replica: its EVALSHA did not run)."""
        try:
            return await self.pipeline(*commands)
        except NoScriptError:
            await self.execute("SCRIPT", "LOAD", source)
            return await self.pipeline(*commands)

    async def connection_id(self, key: Any) -> tuple[str | None, int]:
        """The node (None: the client's one server) and the ``CLIENT ID`` of the
        connection that this link's calls on ``key`` go on: a blocking pop on it can
        be ended by ``unblock``."""
        return None, int(await self.execute("CLIENT", "ID"))

    def node_of(self, key: Any) -> str | None:
        """The name of the node that calls on ``key`` go to (None: one server)."""
        return None

    async def ready(self) -> None:
        """Take and connect the held connection now, unless a call is on it: the next
        call's write then goes out in the caller's task without waiting (a no-op once
        connected).  A caller that lets another write once its own has gone out
        (``producer.enqueuer.Turn``) awaits this first, so that a connect does not
        let the other pass it."""
        conn = self._conn
        if self._busy or (conn is not None and conn.is_connected):
            return
        self._busy = True  # (so that no other call takes a second connection meanwhile)
        try:
            await self._connection()
        finally:
            self._busy = False

    async def release(self) -> None:
        """Give the held connection back to the pool (the next call takes one again)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await self._client.connection_pool.release(conn)

    async def _send_many(self, commands: tuple[tuple[Any, ...], ...], checked: bool
                         ) -> list[Any]:
        conn = await self._connection()
        replies: list[Any] = []
        try:
            await _write(conn, conn.pack_commands(commands))
            for _ in commands:
                replies.append(await _reply(conn))
        except BaseException:
            await conn.disconnect(nowait=True)
            raise
        return self._checked(replies, checked)

    def _checked(self, replies: list[Any], raise_errors: bool) -> list[Any]:
        """``replies``; with ``raise_errors``, the first error reply is raised instead
        (a reply: the connection is in step)."""
        if raise_errors:
            for reply in replies:
                if isinstance(reply, ResponseError):
                    raise reply
        return replies

    async def _connection(self) -> AbstractConnection:
        conn = self._conn
        if conn is None:
            conn = self._conn = await self._client.connection_pool.get_connection()
        if not conn.is_connected:
            await conn.connect()
        return conn


class ClusterLink(LeanLink):
    """``LeanLink`` on a cluster: a call goes on a held connection to the primary that
    owns its keys' slot (all of one call's keys share a hash tag); one connection is
    held per primary called, and taken again when the slot map names a new node.  A
    call goes through the cluster client instead while another is in flight, for a
    command without a key, before the client has read the slot map, and after a broken
    connection (the client then reads the map again): a call's keyless commands
    (``WAIT``, ``MULTI``) then go with its keyed ones; commands redirected (``MOVED``,
    ``ASK``, ``TRYAGAIN``: none of them ran) are sent again through the client, which
    follows the redirection."""

    def __init__(self, client: aioredis.Redis) -> None:
        super().__init__(client)
        self._node: Any = None  # the ClusterNode that ``_conn`` belongs to
        self._held: dict[str, tuple[Any, AbstractConnection]] = {}  # name -> node, conn
        self._mapped = False  # a call through the client succeeded since the last break

    async def ready(self) -> None:
        """Nothing: the node a call goes to is known only from its keys, and on a
        cluster a write may be passed anyway (``LeanLink.ready``)."""

    async def execute(self, *args: Any) -> Any:
        if args[:2] == ("SCRIPT", "LOAD"):
            return await self._client.script_load(args[2])  # on every primary
        return (await self.pipeline(args))[0]

    async def _pipeline(self, commands: tuple[tuple[Any, ...], ...], checked: bool
                        ) -> list[Any]:
        key = _routing_key(commands)
        if self._busy or not self._mapped or key is None:
            return await self._through_client(commands, key, checked)
        self._busy = True
        try:
            await self._pin(self._client.get_node_from_key(key))
            return await self._send_many(commands, checked)
        except _Redirected as redirected:
            return await self._redirect(commands, redirected.replies, checked)
        except ResponseError:
            raise
        except NODE_ERRORS as exc:
            self._mapped = False  # the next call goes through the client...
            await remap_after(self._client, exc)  # ...on a slot map read again
            raise
        except BaseException:
            self._mapped = False  # the next call lets the client notice and remap
            raise
        finally:
            self._busy = False

    async def connection_id(self, key: Any) -> tuple[str | None, int]:
        """The held connection to the primary of ``key``'s slot, by node name and
        ``CLIENT ID`` (the client reads the slot map first if a call broke since)."""
        if not self._mapped:
            await self._pipeline((("EXISTS", key),), checked=True)  # through the client
        _exists, client_id = await self._pipeline((("EXISTS", key), ("CLIENT", "ID")),
                                                  checked=True)
        return self.node_of(key), int(client_id)

    def node_of(self, key: Any) -> str | None:
        try:
            node = self._client.get_node_from_key(key)
        except Exception:  # the slot map is being read again (a failover): ask anew
            return None
        return None if node is None else str(node.name)

    async def _through_client(self, commands: tuple[tuple[Any, ...], ...], key: Any,
                              checked: bool) -> list[Any]:
        try:
            if len(commands) == 1:
                replies = [await self._client.execute_command(*commands[0])]
            else:
                replies = await self._client_pipeline(commands, key, checked)
        except NODE_ERRORS as exc:
            await remap_after(self._client, exc)  # (a pipeline's error does not remap)
            raise
        self._mapped = True
        return replies

    async def _client_pipeline(self, commands: tuple[tuple[Any, ...], ...], key: Any,
                               checked: bool) -> list[Any]:
        """The commands in one pipeline of the cluster client; those without a key
        (``WAIT``, ``MULTI``, ``EXEC``, ``SCRIPT LOAD``) go to the node of ``key``, on
        the same connection as the others (a ``WAIT`` counts its connection's writes:
        sent to the client's default node, it would vouch for nothing)."""
        if key is not None:
            await self._client.initialize()  # (a no-op once the slot map is read)
        node = None if key is None else self._client.get_node_from_key(key)
        pipe: Any = self._client.pipeline(transaction=False)
        transaction = _is_transaction(commands)
        async with pipe:
            for command in commands:
                if node is not None and _first_key(command) is None:
                    pipe.execute_command(*command, target_nodes=node)
                else:
                    pipe.execute_command(*command)
            # a transaction's commands must not be sent again one by one (the client's
            # way with redirections): outside their MULTI, they would run unguarded
            replies = list(await pipe.execute(raise_on_error=checked and not transaction,
                                              allow_redirections=not transaction))
        if transaction:
            await self._refuse_redirected(replies)
            return super()._checked(replies, checked)
        return replies

    async def _refuse_redirected(self, replies: list[Any]) -> None:
        """A transaction of which a command was redirected (``MOVED``, ``ASK``,
        ``TRYAGAIN``): its ``EXEC`` was refused (``EXECABORT``), so none of it ran.  It
        is not sent again piecemeal: the slot map is read anew and the call fails with
        a retryable ``TryAgainError``, to be sent again whole."""
        if not any(isinstance(reply, REDIRECTS) for reply in replies):
            return
        self._mapped = False
        await self._client.nodes_manager.initialize()
        raise TryAgainError("the slot moved while a transaction was sent: none of it ran; "
                            "send it again")

    async def release(self) -> None:
        """Give the held connections back to their nodes' pools."""
        held, self._held, self._conn, self._node = self._held, {}, None, None
        for node, conn in held.values():
            node.release(conn)

    async def _pin(self, node: Any) -> None:
        """Use the connection held to ``node`` (taken at the first call to it; one per
        node, so that calls for models on several nodes do not reconnect)."""
        if node is self._node and self._conn is not None:
            return
        await self._drop_stale()
        held = self._held.get(node.name)
        if held is None:
            held = self._held[node.name] = (node, node.acquire_connection())
        self._node, self._conn = held

    async def _drop_stale(self) -> None:
        """Close the held connections of nodes the slot map no longer names as they
        were (a failed primary, a node object of an older map)."""
        current = self._client.nodes_manager.nodes_cache
        for name, (node, conn) in list(self._held.items()):
            if current.get(name) is not node:
                del self._held[name]
                await conn.disconnect()
                node.release(conn)

    async def _connection(self) -> AbstractConnection:
        conn = self._conn
        assert conn is not None  # (pinned)
        if not conn.is_connected:
            await conn.connect()  # type: ignore[no-untyped-call]
        return conn

    def _checked(self, replies: list[Any], raise_errors: bool) -> list[Any]:
        if any(isinstance(reply, REDIRECTS) for reply in replies):
            raise _Redirected(replies)
        return super()._checked(replies, raise_errors)

    async def _redirect(self, commands: tuple[tuple[Any, ...], ...], replies: list[Any],
                        checked: bool) -> list[Any]:
        """Send the redirected commands again through the client, in order (a ``WAIT``
        after them, answered on the old node, then vouches for nothing: an enqueue
        redirected mid-failover counts as replicated by what the old node saw); a
        transaction is not (``_refuse_redirected``)."""
        if _is_transaction(commands):
            await self._refuse_redirected(replies)
        for index, reply in enumerate(replies):
            if isinstance(reply, REDIRECTS):
                replies[index] = await self._client.execute_command(*commands[index])
        return super()._checked(replies, checked)


GUARD_PEXPIRE_MS = 1000  # the guard's PEXPIRE (of a key that does not exist: a no-op)


async def unblock(client: Any, node: str | None, client_id: int, guard_key: str) -> None:
    """``CLIENT UNBLOCK client_id`` on ``node`` (a cluster's node by name; None: the
    client's one server), through ``client``: another connection than the blocked one.
    A ``PEXPIRE`` of ``guard_key`` (``protocol.unblock_guard_key``) goes first, in the
    same write on the same connection: while ``CLIENT PAUSE WRITE`` holds the pop unrun,
    it holds the unblock as well (see there)."""
    commands = (("PEXPIRE", guard_key, GUARD_PEXPIRE_MS), ("CLIENT", "UNBLOCK", client_id))
    if node is None:
        async with client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            await pipe.execute(raise_on_error=False)
        return
    await client.initialize()  # (a no-op once the slot map is read)
    target = client.get_node(node_name=node)
    if target is not None:  # (a node the slot map no longer names: its pop times out)
        await _on_node(target, commands)


async def _on_node(node: Any, commands: tuple[tuple[Any, ...], ...]) -> None:
    """``commands`` in one write on a connection of cluster node ``node``."""
    conn = node.acquire_connection()
    try:
        if not conn.is_connected:
            await conn.connect()
        await _write(conn, conn.pack_commands(commands))
        for _ in commands:
            await _reply(conn)
    except BaseException:
        await conn.disconnect(nowait=True)
        raise
    finally:
        node.release(conn)


REDIRECTS = (MovedError, AskError, TryAgainError)


def _is_transaction(commands: tuple[tuple[Any, ...], ...]) -> bool:
    """Whether a call holds a ``MULTI`` (its commands run only together)."""
    return any(str(command[0]).upper() == "MULTI" for command in commands if command)


KEYLESS = frozenset({"CLIENT", "SCRIPT", "PING", "CONFIG", "INFO", "WAIT"})
KEYS_AFTER_COUNT = frozenset({"EVALSHA", "EVAL", "BLMPOP", "LMPOP"})  # cmd x numkeys key...


class _Redirected(Exception):
    """Inside ``ClusterLink``: a call's replies, some of them redirections."""

    def __init__(self, replies: list[Any]) -> None:
        super().__init__("redirected")
        self.replies = replies


def _routing_key(commands: tuple[tuple[Any, ...], ...]) -> Any:
    """The first key of a call's commands (None: none has one)."""
    for command in commands:
        key = _first_key(command)
        if key is not None:
            return key
    return None


def _first_key(command: tuple[Any, ...]) -> Any:
    """The first key of one of the hot loops' commands (None: it has none)."""
    name = str(command[0]).upper()
    if name in KEYLESS or len(command) < 2:
        return None
    if name in KEYS_AFTER_COUNT:
        return command[3] if int(command[2]) > 0 else None
    return command[1]


@functools.cache
def script_sha(source: str) -> str:
    """The SHA-1 that EVALSHA names ``source`` by."""
    return hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()


async def _write(conn: AbstractConnection, packed: list[bytes]) -> None:
    """Write in this task: ``send_packed_command`` runs its write under ``wait_for``,
    in a task of its own, one loop iteration later.  Only a write the socket did not
    take at once waits (for the socket timeout at most)."""
    writer: Any = getattr(conn, "_writer", None)  # redis-py's stream, where it has one
    if writer is None or writer.is_closing():
        try:
            await conn.send_packed_command(packed, check_health=False)
        except AttributeError as exc:  # its stream gone before the write ran (a cluster
            # client that reset its nodes disconnects the connections it lent out too)
            raise RedisConnectionError(f"the connection closed while writing: {exc}") from exc
        return
    writer.writelines(packed)
    if writer.transport.get_write_buffer_size():
        await asyncio.wait_for(writer.drain(), conn.socket_timeout)


async def _reply(conn: AbstractConnection) -> Any:
    """One reply; an error reply is returned, so that the next replies are still read."""
    try:
        return await conn.read_response()
    except ResponseError as exc:
        return exc
