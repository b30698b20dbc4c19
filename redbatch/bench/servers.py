"""The servers of a bench run (redbatch, the naive baseline, optionally Ray Serve) as
child processes, and the CPU time they use."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from redbatch.embedded import free_port

W2_X = [i / 64 for i in range(64)]
RAY_APP = Path(__file__).resolve().parent / "baselines" / "ray_app.py"


class Procs:
    """Child processes, stopped by PID (SIGTERM, then SIGKILL) at the end."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.by_name: dict[str, int] = {}

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        log = (self.logdir / f"{name}.log").open("ab")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        self.procs.append(proc)
        self.by_name[name] = proc.pid

    def pids(self, *names: str) -> list[int]:
        return [self.by_name[n] for n in names if n in self.by_name]

    def stop(self) -> None:
        _stop(self.procs)

    def stop_one(self, name: str) -> None:
        pid = self.by_name.pop(name)
        _stop([p for p in self.procs if p.pid == pid])


WRK = Path(__file__).resolve().parent / "wrk"  # the load scripts


def wrk(url: str, lua: str, connections: int, duration_s: float) -> dict[str, Any]:
    """wrk -t1 at ``connections`` for ``duration_s`` with the load script ``lua``: its
    summary (``BENCH_JSON``), with ``errors`` summed."""
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration_s))}s",
                          "--timeout",
                          "5s", "--latency", "-s", str(WRK / lua), url],
                         capture_output=True, text=True, timeout=duration_s + 60, check=True)
    match = re.search(r"BENCH_JSON (\{.*\})", out.stdout)
    if not match:
        raise SystemExit(f"bench: no summary from wrk:\n{out.stdout}\n{out.stderr}")
    result: dict[str, Any] = json.loads(match.group(1))
    errors = sum(result[k] for k in result if k.startswith("err_"))
    result["errors"] = errors
    return result


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM, then SIGKILL whatever is still running after 30 s."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_ok(url: str, body: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.post(url, json=body, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"bench: {url} never answered 200")


def start_redis(procs: Procs, name: str, *args: str) -> int:
    """A redis-server without persistence on a free port (``args``: more options); its
    files (a replica's copy of its primary's data) go to the run's log folder."""
    port = free_port()
    procs.start(name, ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                       "--save", "", "--appendonly", "no", "--dir", str(procs.logdir), *args])
    return port


def start_redbatch(procs: Procs, gateways: int) -> tuple[str, str]:
    redis_port, http_port = start_redis(procs, "redis"), free_port()
    url = f"redis://127.0.0.1:{redis_port}/0"
    env = {"REDBATCH_LOG_LEVEL": "WARNING"}
    start_worker(procs, url, "worker")
    procs.start("gateway", [sys.executable, "-m", "redbatch", "gateway", "--host", "127.0.0.1",
                            "--port", str(http_port), "--workers", str(gateways)],
                {**env, "REDIS_URL": url})
    base = f"http://127.0.0.1:{http_port}"
    wait_ok(f"{base}/v1/models/mlp/predict", {"x": W2_X})
    return url, base


def start_worker(procs: Procs, redis_url: str, name: str) -> None:
    """One worker replica of the demo models (W2's MLP: one torch thread, on the CPU)."""
    procs.start(name, [sys.executable, "-m", "redbatch", "worker", "redbatch.demo:models",
                       "--redis-url", redis_url, "--threads", "1", "--device", "cpu"],
                {"REDBATCH_LOG_LEVEL": "WARNING"})


def start_ray(procs: Procs, python: str, timeout_s: float = 180) -> str:
    """Ray Serve (``ray_app.py``) under ``python``, which must have ray[serve] and torch."""
    port = free_port()
    procs.start("ray", [python, str(RAY_APP)], {"RAY_BENCH_PORT": str(port)})
    base = f"http://127.0.0.1:{port}"
    wait_ok(f"{base}/w2", {"x": W2_X}, timeout_s)
    return base


def start_naive(procs: Procs, name: str = "naive", workers: int = 1) -> str:
    """The naive FastAPI baseline under uvicorn, ``workers`` processes."""
    port = free_port()
    procs.start(name, [sys.executable, "-m", "uvicorn", "redbatch.bench.baselines.naive:app",
                       "--host", "127.0.0.1", "--port", str(port), "--no-access-log",
                       "--log-level", "warning", "--workers", str(workers)])
    base = f"http://127.0.0.1:{port}"
    wait_ok(f"{base}/w2", {"x": W2_X})
    return base


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and all their descendants."""
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in family:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
    return total
