"""HTTP limits at the gateway's edge, below the ASGI app: uvicorn's httptools protocol
with a cap on the size of a request's head and deadlines for its arrival.

uvicorn itself has none of these for httptools: a client may send an endless header
(httptools keeps growing one ``bytes`` object, the whole event loop stalls on the
copies) or keep a connection open by sending nothing, or a byte now and then.
``EdgeProtocol`` counts a request's head bytes (request line and headers) as they
arrive and answers 431 past ``max_header_bytes``, without parsing more than one read
past the cap; it closes a connection whose head has not arrived within
``header_timeout_s`` (a fresh connection that sends nothing included) or whose body has
not arrived within ``body_timeout_s`` of its head, or whose client has read nothing of
its answer for ``send_timeout_s`` (the transport's buffer full: uvicorn's send would wait
on it for ever); and it answers 503 to the requests of
a connection opened while ``max_connections`` are open.  A whole request arriving in
one read (the usual case) costs no timer at all.

``redbatch gateway`` and ``redbatch up`` use it with their ``GatewayConfig``; under
``uvicorn --factory redbatch.api.serve:app_from_env`` pass
``--http redbatch.api.limits:EdgeProtocol`` and it reads the same ``REDBATCH_*`` vars.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, ClassVar

import orjson
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from redbatch.config import GatewayConfig, from_env

log = logging.getLogger("redbatch.api")
HEAD, BODY = "head", "body"  # what a connection is waiting for; None: nothing (idle)
LINGER_S = 1.0  # after a 431, the rest of the request is read and dropped this long


def _error_body(code: str, message: str) -> bytes:
    """The gateway's error shape (``redbatch.api.errors``), for the edge's own answers."""
    return orjson.dumps({"error": {"code": code, "message": message}})


def _answer(status: bytes, code: str, message: str) -> bytes:
    """A whole HTTP answer with a JSON error, closing the connection."""
    text = _error_body(code, message)
    return b"".join([b"HTTP/1.1 ", status, b"\r\ncontent-type: application/json\r\n",
                     b"content-length: %d\r\nconnection: close\r\n\r\n" % len(text),
                     text])


async def _busy(scope: Any, receive: Any, send: Any) -> None:
    """The app of a connection opened past ``max_connections``: 503, then close."""
    text = _error_body("too_many_connections", "too many open connections; retry shortly")
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"connection", b"close"),
        (b"retry-after", b"1"), (b"content-length", b"%d" % len(text))]})
    await send({"type": "http.response.body", "body": text})


@functools.cache
def env_config() -> GatewayConfig:
    """The limits from ``REDBATCH_*`` env vars, for ``--http ...:EdgeProtocol``."""
    return from_env(GatewayConfig)


def edge_protocol(config: GatewayConfig) -> type[EdgeProtocol]:
    """``EdgeProtocol`` with ``config``'s limits, for ``uvicorn.run(http=...)``."""
    class Limited(EdgeProtocol):
        gateway = config

    return Limited


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the gateway's head cap, deadlines and
    connection limit (``GatewayConfig``)."""

    gateway: ClassVar[GatewayConfig | None] = None

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = self.gateway or env_config()
        self._phase: str | None = HEAD
        self._room = self.limits.max_header_bytes  # head bytes the request may still send
        self._requests = 0
        self._completed = 0  # requests whose body has fully arrived
        self._timer: asyncio.TimerHandle | None = None
        self._timed: tuple[str | None, int] = (None, 0)
        self._discarding = False
        self._refusal_due = False  # a 431 waits for the answer in flight (pipelining)
        self._open: list[RequestResponseCycle] = []  # requests not answered yet
        self._stall: asyncio.TimerHandle | None = None  # while writing is paused
        self._unsent = 0  # the write buffer's size when that timer was set

    def send_400_response(self, msg: str) -> None:
        """uvicorn's 400 for what its parser refuses, in the gateway's JSON shape."""
        self.transport.write(_answer(b"400 Bad Request", "bad_request", msg))
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.debug("connection from %s over max_connections=%d: answering 503",
                      self.client, self.limits.max_connections)
            self.app = _busy
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        """uvicorn tells only the last request of the connection that its client is
        gone: with pipelining, the one being answered is an earlier one, which would
        then write to a closed transport (an ERROR) and never see the disconnect."""
        self._cancel()
        self._unstall()
        for cycle in self._open:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # (reading resumes: a request held back goes on)
        if self._refusal_due:
            self._refusal_due = False
            self._send_431()
            return
        self._watch()

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        if self._phase is not BODY and len(data) > self._room:
            self._feed_past_cap(data)
        else:
            if self._phase is not BODY:
                self._room -= len(data)
            super().data_received(data)
        self._watch()

    def _feed_past_cap(self, data: bytes) -> None:
        """Parse up to the cap; the rest only if the head ended within it."""
        room, completed = self._room, self._completed
        self._room = 0
        super().data_received(data[:room])
        if self.transport.is_closing():
            return
        if self._completed > completed:  # a pipelined request ended within the cap: the
            self.data_received(data[room:])  # rest is the next one's, with a fresh cap
            return
        if self._phase is HEAD:
            self._refuse_head()
            return
        super().data_received(data[room:])

    def _refuse_head(self) -> None:
        """431, then read and drop what the client still sends for a moment, so that it
        sees the answer rather than a reset connection.  Behind a request still being
        answered (pipelined), the 431 follows that answer."""
        log.debug("request head from %s over %d bytes: 431", self.client,
                  self.limits.max_header_bytes)
        self._discarding, self._phase = True, None
        self._cancel()
        if self._answering():
            self._refusal_due = True
            return
        self._send_431()

    def _send_431(self) -> None:
        self.transport.write(_answer(b"431 Request Header Fields Too Large",
                                     "header_too_large", "request line and headers are "
                                     f"over the {self.limits.max_header_bytes}-byte limit"))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)

    def _answering(self) -> bool:
        """Whether a request of this connection is still being answered."""
        return self.cycle is not None and not self.cycle.response_complete

    # sends: an answer that its client does not read (writing paused) for send_timeout_s
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._arm_stall()

    def _arm_stall(self) -> None:
        self._unsent = self.transport.get_write_buffer_size()
        self._stall = self.loop.call_later(self.limits.send_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstall()

    def _unstall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        """The client read nothing for ``send_timeout_s``: drop it (``connection_lost``
        tells its requests, whose sends return; a stream's worker is cancelled).  One
        that read some of it meanwhile (the buffer shrank) is given as long again."""
        self._stall = None
        if self.transport.is_closing():
            return
        if self.transport.get_write_buffer_size() < self._unsent:
            self._arm_stall()  # slow, but reading
            return
        log.info("closing the connection from %s: it read nothing of its answer for %g s",
                 self.client, self.limits.send_timeout_s)
        self.transport.abort()

    # parser callbacks: track what the connection waits for
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = HEAD
        self._requests += 1

    def on_headers_complete(self) -> None:
        self._phase = BODY
        super().on_headers_complete()
        self._open = [cycle for cycle in self._open if not cycle.response_complete]
        if self.cycle is not None:
            self._open.append(self.cycle)

    def on_message_complete(self) -> None:
        self._phase, self._room = None, self.limits.max_header_bytes
        self._completed += 1
        super().on_message_complete()

    # deadlines: one timer for the head or body being waited for, if any
    def _watch(self) -> None:
        key = (self._phase, self._requests)
        if key == self._timed or self._discarding:
            return
        self._cancel()
        if self._phase is BODY and self.flow.read_paused:
            return  # uvicorn holds a pipelined body back: timed once it reads again
        self._timed = key
        if self._phase is not None:
            limit_s = (self.limits.header_timeout_s if self._phase is HEAD
                       else self.limits.body_timeout_s)
            self._timer = self.loop.call_later(limit_s, self._expired)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        log.debug("closing the connection from %s: its request %s did not arrive in time",
                  self.client, self._phase)
        if self._phase is HEAD and self._room < self.limits.max_header_bytes and \
                not self._answering():  # (never ahead of an answer still to come)
            self.transport.write(_answer(b"408 Request Timeout", "request_timeout",
                                         "request headers did not arrive in time"))
        self.transport.close()
