"""Run the gateway's app under uvicorn: bind first (a taken port is one clear error),
say "listening" only once the server listens, and stop when a shared event is set
(``redbatch up``: a signal, or a worker pool that gave up)."""

from __future__ import annotations

import logging
import socket
import threading
from types import FrameType
from typing import Any

import uvicorn

from redbatch.errors import ConfigError

log = logging.getLogger("redbatch")


class GatewayServer(uvicorn.Server):
    """``uvicorn.Server`` that logs after it started listening, sets ``stop`` when a
    signal reaches it (before anything else reacts to that signal), and exits when
    ``stop`` is set."""

    def __init__(self, config: uvicorn.Config, stop: threading.Event) -> None:
        super().__init__(config)
        self.stop = stop

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            log.info("gateway listening on http://%s:%d", self.config.host, self.config.port)

    async def on_tick(self, counter: int) -> bool:
        return self.stop.is_set() or await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.stop.set()
        super().handle_exit(sig, frame)


def bind(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, or a ``ConfigError`` naming the address."""
    try:
        return socket.create_server((host, port), family=_family(host), backlog=2048)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"gateway cannot listen on {host}:{port}: {reason} (another "
                          "process has the port? pick one with --port)") from exc


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def run(app: Any, stop: threading.Event | None = None, **settings: Any) -> None:
    """``uvicorn.run(app, **settings)`` on a socket bound first; returns when the server
    stops (a signal, or ``stop`` set)."""
    config = uvicorn.Config(app, **settings)
    sock = bind(config.host, config.port)
    server = GatewayServer(config, stop or threading.Event())
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if not server.started:
        raise ConfigError("the gateway did not start (see the error above)")
