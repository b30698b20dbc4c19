"""Several hosts on one machine: network namespaces on a private /24.

``Network`` makes a bridge in the root namespace (its address ``.1``) and, per host,
a network namespace joined to the bridge by a veth pair (``.2``, ``.3``, ...).  A
host's loopback stays down, so a process there reaches the others only at their
veth addresses: nothing can lean on 127.0.0.1.

Names carry this process's id and a letter (``rbn<pid><letter>``), so parallel runs
never collide; the subnet is drawn from 10.200-254.x.0/24 among those not routed yet.
``close()`` (also on leaving the ``with`` block, whatever happened) stops every
process started in a host, deletes the namespaces and the bridge; a run killed before
that leaves names whose pid is dead, which the next ``Network`` removes.

Needs root and ``ip netns`` (``available()`` says why not).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import re
import shutil
import signal
import string
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

PREFIX = "rbn"
STALE = re.compile(rf"{PREFIX}(\d+)[a-z]")
_LETTERS = itertools.cycle(string.ascii_lowercase)
STOP_TIMEOUT_S = 10.0


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = _ip_run("netns", "list")
    return None if probe.returncode == 0 else f"ip netns is unavailable: {probe.stderr}"


def _ip_run(*args: str) -> subprocess.CompletedProcess[str]:
    """``ip ARGS``, whatever its exit status (teardown goes on past a failure)."""
    return subprocess.run(["ip", *args], check=False, capture_output=True, text=True,
                          timeout=10)


def ip(*args: str) -> str:
    done = _ip_run(*args)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Namespaces and bridges left by runs whose process is gone."""
    for name in ip("netns", "list").split():
        if (found := STALE.match(name)) and not _alive(int(found[1])):
            _delete_netns(name)
    for name in re.findall(rf"^\d+: ({PREFIX}\d+[a-z])[:@]", ip("-o", "link"), re.M):
        if (found := STALE.match(name)) and not _alive(int(found[1])):
            _ip_run("link", "del", name)


def _delete_netns(name: str) -> None:
    """Kill what still runs in the namespace, then delete it (its veth goes with it)."""
    for pid in _ip_run("netns", "pids", name).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    _ip_run("netns", "del", name)


def _free_subnet() -> str:
    """``10.A.B`` (a /24) that no route of this machine covers yet."""
    routes = ip("-4", "route", "show", "table", "all")
    for _ in range(200):
        prefix = f"10.{random.randint(200, 254)}.{random.randint(0, 255)}"
        if f"{prefix}." not in routes:
            return prefix
    raise RuntimeError("no free 10.200-254.x.0/24 subnet")


@dataclass
class Host:
    """One network namespace with one address; processes started in it are tracked."""

    netns: str
    address: str
    logdir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def command(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *args]

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        """``args`` in this namespace, output to ``<logdir>/<name>.log``."""
        with (self.logdir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(self.command(*args), stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, args: list[str], env: dict[str, str] | None = None, timeout_s: float = 30
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(*args), check=False, capture_output=True, text=True,
                              env=env, timeout=timeout_s)

    def stop(self) -> None:
        """SIGTERM to each process group, SIGKILL to those still there after a while."""
        for proc in self.procs:
            _signal(proc, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait(STOP_TIMEOUT_S)


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


@dataclass
class Network:
    """A bridge and private /24 in the root namespace, and hosts on it (``add``)."""

    logdir: Path
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}{next(_LETTERS)}")
    subnet: str = ""
    hosts: list[Host] = field(default_factory=list)

    def __enter__(self) -> Network:
        remove_stale()
        self.subnet = _free_subnet()
        try:
            ip("link", "add", self.tag, "type", "bridge")
            ip("addr", "add", f"{self.subnet}.1/24", "dev", self.tag)
            ip("link", "set", self.tag, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def gateway_address(self) -> str:
        """The root namespace's address on the bridge."""
        return f"{self.subnet}.1"

    def add(self) -> Host:
        """A new namespace with the next address, joined to the bridge."""
        index = len(self.hosts) + 2
        host = Host(f"{self.tag}-{index}", f"{self.subnet}.{index}", self.logdir)
        self.hosts.append(host)
        ip("netns", "add", host.netns)
        ip("link", "add", f"{self.tag}h{index}", "type", "veth", "peer", "name", "eth0",
           "netns", host.netns)
        ip("link", "set", f"{self.tag}h{index}", "master", self.tag, "up")
        ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip("-n", host.netns, "link", "set", "eth0", "up")
        return host

    def close(self) -> None:
        """Stop every host's processes, delete the namespaces, then the bridge."""
        for host in self.hosts:
            host.stop()
        for host in self.hosts:
            _delete_netns(host.netns)
        _ip_run("link", "del", self.tag)
        self.hosts.clear()
