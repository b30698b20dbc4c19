"""Redis's own cost per request in a bench run: one ``INFO cpu commandstats`` before a
measured run and one after.  Divided by the requests (or items) the run served:

* ``redis_cpu_us_per_request``: the server's main-thread CPU (``used_cpu_user`` +
  ``used_cpu_sys`` of the main thread; of the whole process on a Redis without the
  per-thread fields), all that its event loop did: network I/O, parsing, commands,
  scripts, and the heartbeats and admission reads beside the load;
* ``redis_cmd_us_per_request``: the time inside each command (``INFO commandstats``
  ``usec``), by command.  A script's ``evalsha`` includes the commands it calls, which
  are also counted under their own names: these do not add up.
"""

from __future__ import annotations

from typing import Any

import redis

CPU_S = "redis_cpu_s"
CMD_US = "redis_cmd_us:"  # + the command's name
CALLS = "redis_calls"  # commands served, all of them


def snapshot(redis_url: str) -> dict[str, float]:
    """The server's CPU seconds and per-command microseconds so far (one round trip)."""
    client = redis.Redis.from_url(redis_url)
    try:
        info: dict[str, Any] = client.info("cpu", "commandstats")
    finally:
        client.close()
    return parse(info)


def parse(info: dict[str, Any]) -> dict[str, float]:
    """``snapshot``'s figures from a parsed ``INFO cpu commandstats``."""
    user = info.get("used_cpu_user_main_thread", info["used_cpu_user"])
    system = info.get("used_cpu_sys_main_thread", info["used_cpu_sys"])
    stats = {k.removeprefix("cmdstat_"): v for k, v in info.items()
             if k.startswith("cmdstat_")}
    return {CPU_S: float(user) + float(system),
            CALLS: float(sum(v["calls"] for v in stats.values())),
            **{CMD_US + name: float(v["usec"]) for name, v in stats.items()}}


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What a run cost, from its two snapshots (a command first seen after it counts
    from zero)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()
            if value != before.get(key, 0.0)}


def total(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The ``spent`` figures of several rounds (kept in each round's result), summed."""
    sums: dict[str, float] = {}
    for run in runs:
        for key, value in run.items():
            if key == CPU_S or key.startswith(CMD_US):
                sums[key] = sums.get(key, 0.0) + value
    return sums


def per_request(totals: dict[str, float], requests: float, unit: str = "request"
                ) -> dict[str, Any]:
    """Totals as microseconds per request (or per ``unit``); commands costliest first,
    those under 0.01 µs left out."""
    count = max(requests, 1.0)
    commands = sorted(((k.removeprefix(CMD_US), v / count) for k, v in totals.items()
                       if k.startswith(CMD_US)), key=lambda kv: -kv[1])
    return {f"redis_cpu_us_per_{unit}": totals.get(CPU_S, 0.0) * 1e6 / count,
            f"redis_cmd_us_per_{unit}": {name: round(us, 2) for name, us in commands
                                         if round(us, 2)}}


def shown(figures: dict[str, Any], unit: str = "request") -> str:
    """Redis's CPU µs per request (or ``unit``) of a figure, for a table; ``-`` for a
    figure not served through Redis."""
    us = figures.get(f"redis_cpu_us_per_{unit}")
    return "-" if us is None else f"{us:.1f}"
