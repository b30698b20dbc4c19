"""The gateway's HTTP edge (``redbatch/api/limits.py``) over a real port: a real
``redbatch gateway`` process, raw sockets for the hostile clients."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from redbatch.config import GatewayConfig, from_env
from redbatch.errors import ConfigError
from tests.conftest import Proc, free_port, redbatch_cmd, test_env, wait_http

SLOW_HEAD = b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Slow: a"


Gateway = Callable[..., tuple[int, Proc]]


@pytest.fixture
def gateway(spawn: Callable[..., Proc], redis_url: str) -> Gateway:
    """Starts one gateway process (its own memory is measured) with extra env vars:
    returns its port and process."""
    def start(**env: str) -> tuple[int, Proc]:
        port = free_port()
        proc = spawn(redbatch_cmd("gateway", "--port", str(port), "--workers", "1"),
                     env=test_env(REDIS_URL=redis_url, **env), name="gateway")
        wait_http(f"http://127.0.0.1:{port}/healthz", 60, proc)
        return port, proc
    return start


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _read_all(sock: socket.socket, into: list[bytes]) -> None:
    try:
        while chunk := sock.recv(65536):
            into.append(chunk)
    except OSError:
        pass


def _send_huge_header(port: int, size: int) -> bytes:
    """Send a request whose one header is ``size`` bytes; what came back."""
    got: list[bytes] = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        reader = threading.Thread(target=_read_all, args=(sock, got))
        reader.start()
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Big: ")
            chunk = b"a" * (1 << 20)
            for _ in range(size >> 20):
                sock.sendall(chunk)
            sock.sendall(b"\r\n\r\n")
        except OSError:
            pass  # the gateway answered and closed before the end: that is the point
        reader.join(30)
    return b"".join(got)


def _closed_within(sock: socket.socket, timeout_s: float) -> bytes | None:
    """What the server sent before closing, or None if it kept the connection open."""
    sock.settimeout(timeout_s)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        return None
    except OSError:
        pass
    return got


@pytest.mark.timeout(120)
def test_pipelined_requests_under_the_cap_are_all_served(gateway: Gateway) -> None:
    """Many small requests in one write pass the cap together, never one by one."""
    port, _proc = gateway()
    one = b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Pad: " + b"a" * 3000 + b"\r\n\r\n"
    last = b"GET /healthz HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(one * 60 + last)  # ~180 KiB: one read crosses the 64 KiB cap
        got = _closed_within(sock, 30)
    assert got is not None, "the gateway kept the connection open"
    assert got.count(b"HTTP/1.1 200") == 61 and b" 431 " not in got, got[:300]


@pytest.mark.timeout(120)
def test_a_huge_header_gets_431_and_memory_stays_bounded(gateway: Gateway) -> None:
    port, proc = gateway()
    answer = _send_huge_header(port, 1 << 20)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert _error_of(answer) == ("header_too_large", "application/json")
    assert b"65536-byte limit" in answer
    before = _peak_rss_kib(proc.popen.pid)
    answer = _send_huge_header(port, 64 << 20)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    grown_mib = (_peak_rss_kib(proc.popen.pid) - before) / 1024
    assert grown_mib < 16, f"peak memory grew {grown_mib:.0f} MiB for a 64 MiB header"
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
    fine = httpx.get(f"http://127.0.0.1:{port}/healthz", headers={"x-ok": "a" * 30_000})
    assert fine.status_code == 200  # a big head under the cap is served
    head = b"POST /v1/models/m/predict HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json"
    payload = b'{"inputs": "' + b"a" * 500_000 + b'"}'
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + b"\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        status = sock.recv(4096).split(b"\r\n", 1)[0]
    assert status != b"HTTP/1.1 431 Request Header Fields Too Large"  # body bytes don't count
    assert status.startswith(b"HTTP/1.1 "), status


@pytest.mark.timeout(120)
def test_slow_clients_are_closed_while_others_are_served(gateway: Gateway) -> None:
    port, _ = gateway(REDBATCH_HEADER_TIMEOUT_S="1",
                       REDBATCH_BODY_TIMEOUT_S="1")
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(30)]
    for sock in slow[:20]:
        sock.sendall(SLOW_HEAD)  # a partial head, then nothing
    for sock in slow[20:25]:  # a whole head and part of the body
        sock.sendall(b"POST /v1/models/m/predict HTTP/1.1\r\nHost: gw\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"inputs\"")
    # slow[25:] send nothing at all
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        assert http.get("/healthz").status_code == 200
    try:
        answers = [_closed_within(sock, 20) for sock in slow]
    finally:
        for sock in slow:
            sock.close()
    assert None not in answers, [i for i, a in enumerate(answers) if a is None]
    assert all(a is not None and a.startswith(b"HTTP/1.1 408") for a in answers[:20]), \
        answers[:20]
    assert _error_of(answers[0] or b"") == ("request_timeout", "application/json")
    assert answers[25:] == [b""] * 5  # nothing asked, nothing answered: just closed


def test_a_client_that_reads_nothing_of_its_answers_is_closed(gateway: Gateway) -> None:
    port, proc = gateway(REDBATCH_SEND_TIMEOUT_S="1")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        size = len(http.get("/openapi.json").content)
    count = 300  # answers far past the socket buffers of both ends
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: gw\r\n\r\n" * count)
        time.sleep(3)  # reads nothing: the gateway's send waits on a full buffer
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            assert http.get("/healthz").status_code == 200  # the others are served
        got: list[bytes] = []
        sock.settimeout(20)
        _read_all(sock, got)  # what the buffers held, then the end: it was closed
    assert sum(map(len, got)) < count * size / 2, sum(map(len, got))
    assert "read nothing of its answer for 1 s" in proc.log()


@pytest.mark.timeout(120)
def test_connections_past_the_limit_are_refused(gateway: Gateway) -> None:
    port, _ = gateway(REDBATCH_MAX_CONNECTIONS="4",
                       REDBATCH_HEADER_TIMEOUT_S="60")
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    url = f"http://127.0.0.1:{port}/healthz"
    deadline = time.monotonic() + 30
    refused = httpx.get(url, timeout=10)
    while refused.status_code == 200 and time.monotonic() < deadline:  # not all accepted
        time.sleep(0.1)
        refused = httpx.get(url, timeout=10)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "too_many_connections"
    assert "too many open connections" in refused.json()["error"]["message"]
    for sock in held:
        sock.close()
    for _ in range(100):
        if httpx.get(url, timeout=10).status_code == 200:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the gateway never served again once the connections closed")



HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n"


def _error_of(answer: bytes) -> tuple[str, str]:
    """A raw answer's JSON error code and its content type."""
    head, _, body = answer.partition(b"\r\n\r\n")
    types = [line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
             if line.lower().startswith(b"content-type:")]
    return json.loads(body)["error"]["code"], types[0]


@pytest.mark.timeout(120)
def test_what_the_parser_refuses_is_a_json_400(gateway: Gateway) -> None:
    port, _proc = gateway()
    for bad in (b"POST /healthz HTTP/1.1\r\nHost: gw\r\nContent-Length: 1\r\n"
                b"Content-Length: 2\r\n\r\nab",
                b"POST /healthz HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"zz\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(bad)
            answer = _closed_within(sock, 10)
        assert answer is not None and answer.startswith(b"HTTP/1.1 400"), answer
        assert _error_of(answer) == ("bad_request", "application/json")


def _answer(sock: socket.socket) -> bytes:
    """One whole answer to ``HEALTHZ`` (its body is a small JSON object)."""
    got = b""
    while not got.endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


@pytest.mark.timeout(120)
def test_an_idle_connection_outlives_the_clients_keep_alive(gateway: Gateway) -> None:
    """A connection idle for 5.5 s (past httpx's 5 s expiry, and uvicorn's own 5 s
    default) is still open and served: a client reusing it never races its close."""
    port, _proc = gateway()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(HEALTHZ)
        assert _answer(sock).startswith(b"HTTP/1.1 200")
        time.sleep(5.5)
        sock.sendall(HEALTHZ)
        assert _answer(sock).startswith(b"HTTP/1.1 200")


@pytest.mark.timeout(120)
def test_an_idle_connection_is_closed_after_keep_alive_s(gateway: Gateway) -> None:
    port, _proc = gateway(REDBATCH_KEEP_ALIVE_S="0.5")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(HEALTHZ)
        assert _answer(sock).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        assert _closed_within(sock, 10) == b"", "the idle connection was kept open"
        assert 0.3 < time.monotonic() - started < 5


def _predict(value: int) -> bytes:
    body = b'{"inputs": %d}' % value
    return (b"POST /v1/models/slow/predict HTTP/1.1\r\nHost: gw\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


@pytest.fixture
def slow_gateway(gateway: Gateway, spawn: Callable[..., Proc], redis_url: str
                 ) -> tuple[int, Proc]:
    """A gateway (bodies due within 1 s) and a worker whose passes take 1.5 s."""
    spawn(redbatch_cmd("worker", "tests.models_for_tests:slow", "--redis-url", redis_url),
          env=test_env(SLOW_FORWARD_S="1.5"), name="slow-worker")
    port, proc = gateway(REDBATCH_BODY_TIMEOUT_S="1")
    wait_http(f"http://127.0.0.1:{port}/readyz", 60, proc)
    return port, proc


def _answers(sock: socket.socket, timeout_s: float) -> list[bytes]:
    got = _closed_within(sock, timeout_s) or b""
    return [part.split(b"\r\n", 1)[0] for part in got.split(b"HTTP/1.1 ")[1:]]


@pytest.mark.timeout(120)
def test_a_pipelined_body_held_back_is_not_timed_while_held(
        slow_gateway: tuple[int, Proc]) -> None:
    """uvicorn reads a pipelined request's body only once the request before it is
    answered: the body deadline must not run meanwhile (it cut both, unanswered)."""
    port, proc = slow_gateway
    second = _predict(2).replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n")
    head, _, body = second.partition(b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(_predict(1))
        time.sleep(0.1)
        sock.sendall(head + b"\r\n\r\n")
        time.sleep(0.1)
        sock.sendall(body)
        assert _answers(sock, 20) == [b"200 OK", b"200 OK"]
    assert "ERROR" not in proc.log(), proc.log()


@pytest.mark.timeout(120)
def test_a_client_gone_with_pipelined_requests_logs_no_error(
        slow_gateway: tuple[int, Proc]) -> None:
    port, proc = slow_gateway
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(_predict(1) + _predict(2))
        time.sleep(0.3)
    time.sleep(3)  # both would have been answered by now
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
    assert "ERROR" not in proc.log() and "Traceback" not in proc.log(), proc.log()


@pytest.mark.timeout(120)
def test_a_431_pipelined_behind_a_request_follows_its_answer(
        slow_gateway: tuple[int, Proc]) -> None:
    port, proc = slow_gateway
    huge = b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Big: " + b"a" * 300_000 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(_predict(1) + huge)
        assert _answers(sock, 20) == [b"200 OK", b"431 Request Header Fields Too Large"]
    assert "ERROR" not in proc.log(), proc.log()


def test_edge_limits_are_validated_and_read_from_env() -> None:
    with pytest.raises(ConfigError, match="max_header_bytes"):
        GatewayConfig(max_header_bytes=100)
    for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "max_connections"):
        with pytest.raises(ConfigError, match=name):
            GatewayConfig(**{name: 0})
    config = from_env(GatewayConfig, env={"REDBATCH_MAX_HEADER_BYTES": "8192",
                                          "REDBATCH_HEADER_TIMEOUT_S": "2.5",
                                          "REDBATCH_MAX_CONNECTIONS": "10"})
    assert (config.max_header_bytes, config.header_timeout_s, config.max_connections) == (
        8192, 2.5, 10)


def test_a_client_that_reads_slowly_keeps_its_answer() -> None:
    """The send timeout is for a client that reads nothing: one that reads a large
    answer steadily, though for longer than the timeout, gets all of it."""
    import uvicorn

    from redbatch.api.limits import edge_protocol

    body = b"x" * (12 << 20)  # past the kernel's socket buffers: the rest waits in the gateway

    async def app(scope: dict[str, object], receive: object, send: Callable[..., object]
                  ) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,  # type: ignore[misc]
                    "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})  # type: ignore[misc]

    port = free_port()
    config = GatewayConfig(send_timeout_s=1.0)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                           http=edge_protocol(config), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        got, started = 0, time.monotonic()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET / HTTP/1.1\r\nHost: gw\r\n\r\n")
            sock.settimeout(20)
            while got < len(body) and (chunk := sock.recv(1 << 20)):
                got += len(chunk)
                time.sleep(0.02)  # steady, but the whole answer takes seconds
        assert got >= len(body), got  # (head included: at least the body's bytes)
        assert time.monotonic() - started > 1.0  # longer than the send timeout
    finally:
        server.should_exit = True
        thread.join(10)
