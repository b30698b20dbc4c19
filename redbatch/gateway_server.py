"""Run the gateway's app under uvicorn: bind first (a taken port is one clear error),
say "listening" only once the server listens, and stop when a shared event is set
(``redbatch up``: a signal, or a worker pool that gave up).  Several gateway
processes (``redbatch.gateway_procs``) each serve on a socket of their own, bound here
with ``SO_REUSEPORT`` by the parent."""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from redbatch import supervised
from redbatch.errors import ConfigError

if TYPE_CHECKING:
    from redbatch.config import GatewayConfig, RedisSettings

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
        if sig == signal.SIGINT and supervised.is_supervised():
            return  # a gateway process of several: its parent stops it, in order
        self.stop.set()
        super().handle_exit(sig, frame)


# a host that does not resolve (create_server re-raises getaddrinfo's error as an
# OSError of its number), or an address of another machine
NOT_AN_ADDRESS = frozenset({errno.EADDRNOTAVAIL, socket.EAI_NONAME, socket.EAI_AGAIN,
                            socket.EAI_FAIL, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)})


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The gateway's listening socket, or a ``ConfigError`` naming the address."""
    try:
        return socket.create_server((host, port), family=_family(host), backlog=2048,
                                    reuse_port=reuse_port)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        hint = (f"is {host!r} an address of this machine? pick one with --host"
                if exc.errno in NOT_AN_ADDRESS
                else "another process has the port? pick one with --port")
        raise ConfigError(f"gateway cannot listen on {host}:{port}: {reason} ({hint})"
                          ) from exc


def bind_shared(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening sockets on one address with ``SO_REUSEPORT``: the kernel
    spreads new connections over them.  A plain bind first makes a port that another
    process holds one clear error, even one that shares it with ``SO_REUSEPORT``."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ConfigError("several gateway processes need SO_REUSEPORT, which this "
                          "system lacks: run one (--workers 1)")
    bind(host, port).close()
    return [bind(host, port, reuse_port=True) for _ in range(count)]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def serve(config: GatewayConfig, redis: RedisSettings, stop: threading.Event | None = None,
          sock: socket.socket | None = None) -> None:
    """Serve the gateway until a signal (or ``stop``), on ``sock`` when given (a
    process of several), else on a socket bound here; logs "listening" once it
    listens, and a taken port is a ``ConfigError``."""
    from redbatch.api import create_app
    from redbatch.api.limits import edge_protocol
    from redbatch.heap import freeze_startup_heap

    app = create_app(config, redis)
    freeze_startup_heap()
    run(app, stop, sock, host=config.host, port=config.port, log_level="warning",
        access_log=False, http=edge_protocol(config), timeout_keep_alive=config.keep_alive_s)


def run(app: Any, stop: threading.Event | None = None, sock: socket.socket | None = None,
        **settings: Any) -> None:
    """``uvicorn.run(app, **settings)`` on ``sock``, or on a socket bound first;
    returns when the server stops (a signal, or ``stop`` set)."""
    config = uvicorn.Config(app, **settings)
    sock = sock or bind(config.host, config.port)
    server = GatewayServer(config, stop or threading.Event())
    try:
        server.run(sockets=[sock])
    except SystemExit as exc:  # uvicorn's exit 3 when the app's startup failed
        if server.started:
            raise
        raise ConfigError("the gateway did not start (see the error above)") from exc
    finally:
        sock.close()
    if not server.started:
        raise ConfigError("the gateway did not start (see the error above)")
