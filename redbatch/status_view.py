"""Drawing ``redbatch status`` in a terminal (rich), once or live with ``--watch``."""

from __future__ import annotations

import json
from collections import Counter

import redis
from rich.console import Console
from rich.live import Live
from rich.table import Table

from redbatch import status
from redbatch.config import RedisSettings
from redbatch.errors import RedisUnavailable
from redbatch.pipelines import status as pipeline_status
from redbatch.redis_conn import REDIS_ERRORS, sync_client

COLUMNS = ("model", "queue", "workers (devices)", "items/s", "max batch / window",
           "items/pass mean / p50 / p99",
           "entries/batch mean / p50 / p99", "queue wait p50 / p99", "forward p50 / p99",
           "dead letters", "workers needed")
AUTO_COLUMN = "auto size per bucket"  # shown when a model has auto_batch on
LIVE_COLUMN = "other live changes"  # shown when a model has overrides not shown above
SHOWN_KNOBS = frozenset({"max_batch_size", "batch_wait_timeout_s", "auto_batch",
                         "priority_caps"})  # the knobs the other columns show


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _devices(s: status.ModelStatus) -> str:
    counts = Counter(str(w.get("device", "?")) for w in s.workers)
    return f"{len(s.workers)} (" + ", ".join(f"{n}x {d}" for d, n in counts.items()) + ")" \
        if s.workers else "0"


def _knob(s: status.ModelStatus, name: str, text: str) -> str:
    """A knob's value in effect, starred when a live override sets it."""
    return text + ("*" if name in s.overrides else "")


def _batching(s: status.ModelStatus) -> str:
    size, wait_s = s.knobs.get("max_batch_size"), s.knobs.get("batch_wait_timeout_s")
    if size is None or wait_s is None:
        return "-"
    auto = _knob(s, "auto_batch", "auto") + " " if s.knobs.get("auto_batch") else ""
    return (f"{auto}{_knob(s, 'max_batch_size', str(size))} / "
            f"{_knob(s, 'batch_wait_timeout_s', _ms(wait_s * 1000))}")


def _queue(s: status.ModelStatus) -> str:
    """The queue depth; per priority level too, ``12 (p1:2 p2:10)``, with the level
    caps changed live marked."""
    if not s.queue_depths:
        return str(s.queue_depth)
    levels = " ".join(f"p{level}:{n}" for level, n in s.queue_depths.items())
    caps = s.knobs.get("priority_caps")
    capped = f" caps {_knob(s, 'priority_caps', '/'.join(map(str, caps)))}" if caps else ""
    return f"{s.queue_depth} ({levels}){capped}"


def _needed(s: status.ModelStatus) -> str:
    """Workers needed (``redbatch.scaling``), with the difference from the live ones:
    ``3 (+1)``."""
    if s.workers_needed is None:
        return "-"
    change = s.workers_needed - len(s.workers)
    return f"{s.workers_needed}" + (f" ({change:+d})" if change else "")


def _auto(s: status.ModelStatus) -> str:
    """``bucket:size`` per length bucket under ``auto_batch``, else ``-``."""
    return " ".join(f"{b}:{n}" for b, n in s.auto_sizes.items()) or "-"


def _unshown(s: status.ModelStatus) -> dict[str, object]:
    """The live changes the other columns do not show: those of other knobs, and
    ``auto_batch`` turned off (the batching column marks it only while it is on)."""
    return {name: value for name, value in sorted(s.overrides.items())
            if name not in SHOWN_KNOBS or (name == "auto_batch" and not value)}


def _live(s: status.ModelStatus) -> str:
    """The live changes the other columns do not show (``redbatch config``):
    ``max_batch_cost=4096 buckets=[8, 16, 512]``, else ``-``."""
    return " ".join(f"{name}={json.dumps(value)}" for name, value in _unshown(s).items()) \
        or "-"


def table(statuses: dict[str, status.ModelStatus]) -> Table:
    out = Table(title="redbatch status", caption="distributions since each worker started; "
                "* changed live (redbatch config)")
    auto = (AUTO_COLUMN,) if any(s.auto_sizes for s in statuses.values()) else ()
    live = (LIVE_COLUMN,) if any(_unshown(s) for s in statuses.values()) else ()
    names = max((len(name) for name in statuses), default=5)
    for column in COLUMNS[:5] + auto + live + COLUMNS[5:]:
        if column == "model":  # whole, however narrow the output (a pipe: 80 columns)
            out.add_column(column, justify="left", no_wrap=True, min_width=names)
        else:
            out.add_column(column, justify="right")
    for s in statuses.values():
        out.add_row(s.model, _queue(s), _devices(s), _num(s.items_per_s),
                    _batching(s), *(_auto(s) for _ in auto), *(_live(s) for _ in live),
                    f"{s.mean_batch:.1f} / {_num(s.batch_size_p50)} / {_num(s.batch_size_p99)}",
                    f"{s.mean_entries:.1f} / {_num(s.entries_p50)} / {_num(s.entries_p99)}",
                    f"{_ms(s.queue_wait_ms_p50)} / {_ms(s.queue_wait_ms_p99)}",
                    f"{_ms(s.forward_ms_p50)} / {_ms(s.forward_ms_p99)}", str(s.dead_letters),
                    _needed(s))
    return out


def run(settings: RedisSettings, *, as_json: bool, watch: bool, interval_s: float) -> int:
    """Print the status (or keep it on screen); ``RedisUnavailable`` (exit 2) when
    Redis cannot be read (a cluster's client reads its slot map as it is made)."""
    try:
        client = sync_client(settings)
        try:
            _show(client, as_json=as_json, watch=watch, interval_s=interval_s)
        finally:
            client.close()
    except (redis.RedisError, *REDIS_ERRORS) as exc:
        raise RedisUnavailable(f"cannot read redis at {settings.safe_url}: {exc}") from exc
    return 0


def _show(client: redis.Redis, *, as_json: bool, watch: bool, interval_s: float) -> None:
    if watch:
        _watch(client, interval_s)
        return
    snap = status.sample(client, interval_s)
    pipes = pipeline_status.read(client, snap)
    if as_json:
        print(json.dumps({**status.as_json(snap),
                          "pipelines": pipeline_status.as_json(pipes)}, indent=2), end="")
        return
    Console().print(table(snap))
    if pipes:
        Console().print(pipeline_status.table(pipes))


def _watch(client: redis.Redis, interval_s: float) -> None:
    """Redraw every ``interval_s`` until Ctrl-C."""
    with Live(table(status.sample(client, interval_s)), refresh_per_second=4) as live:
        while True:
            live.update(table(status.sample(client, interval_s)))
