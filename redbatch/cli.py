"""``redbatch up | gateway | worker``: flags override ``REDBATCH_*`` env vars."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from redbatch import __version__, defaults
from redbatch.config import (
    GatewayConfig,
    RedisSettings,
    WorkerConfig,
    check_gateway,
    from_env,
    seconds_flag,
    tls_unverified,
)
from redbatch.errors import ConfigError, RedbatchError
from redbatch.extras import missing_extra
from redbatch.knobs_cli import cmd_config
from redbatch.knobs_cli import register as register_config
from redbatch.logs import setup_logging
from redbatch.versions_cli import cmd_versions
from redbatch.versions_cli import register as register_versions

log = logging.getLogger("redbatch")
DEMO_TARGET = "redbatch.demo:models"
PROCESSES_HELP = (f"gateway processes sharing the port, 1-64 ({defaults.GATEWAY_PROCESSES}; "
                  "$REDBATCH_GATEWAY_PROCESSES); over 1, /metrics sums them all")


def _add_redis(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", help="Redis URL (default: $REDIS_URL)")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (INFO)")


def _add_gateway(parser: argparse.ArgumentParser, block_help: str = "reply listener's "
                 "blocking pop timeout (1.0)") -> None:
    parser.add_argument("--host", help="bind address (127.0.0.1; $REDBATCH_HOST)")
    parser.add_argument("--port", type=int, help="port (8000; $REDBATCH_PORT)")
    parser.add_argument("--default-timeout-s", type=float, help="deadline when the client "
                        "sets none (30)")
    parser.add_argument("--max-timeout-s", type=float, help="longest deadline allowed (60)")
    parser.add_argument("--max-body-bytes", type=int, help="request body limit (1 MiB)")
    parser.add_argument("--max-queue-len", type=int, help="cap of each model queue (10000)")
    parser.add_argument("--block-timeout-s", type=float, help=block_help)


def _add_worker(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, help="worker processes (1)")
    parser.add_argument("--device", help="auto, cpu, cuda or cuda:0,cuda:1 (auto)")
    parser.add_argument("--threads", type=int, help="CPU threads per replica (1)")
    parser.add_argument("--lease-ttl-s", type=float, help="worker lease (10)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus /metrics of replica i on "
                        "this port + i (0: off; $REDBATCH_METRICS_PORT)")
    parser.add_argument("--max-failed-starts", type=int, help="stop when a replica failed "
                        "this many starts in a row without serving (5)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="redbatch", description="Dynamic-batching inference over Redis lists. Flags "
        "override REDBATCH_* environment variables, which override defaults.")
    parser.add_argument("--version", action="version", version=f"redbatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="gateway + workers + demo model, one command")
    up.add_argument("--models", help=f"MODULE:OBJECT ({DEMO_TARGET})")
    up.add_argument("-c", "--config", help="a TOML file describing the gateway and the "
                    "models (see docs/configuration.md); flags given too override it")
    _add_redis(up)
    _add_gateway(up, "blocking pop timeout of the gateway's reply listener and of the "
                 "workers' claims (1.0)")  # (one flag serves both)
    _add_worker(up)
    up.add_argument("--gateways", type=int, dest="gateway_processes", metavar="N",
                    help=PROCESSES_HELP)
    gateway = sub.add_parser("gateway", help="run the HTTP gateway alone")
    _add_redis(gateway)
    _add_gateway(gateway)
    gateway.add_argument("--workers", type=int, dest="gateway_processes", metavar="N",
                         help=PROCESSES_HELP)
    sub.add_parser("bench", help="benchmarks W1/W2 vs the naive server and the bare model "
                   "(redbatch bench --help)", add_help=False)
    worker = sub.add_parser("worker", help="run worker processes for MODULE:OBJECT")
    worker.add_argument("target", help="MODULE:OBJECT: a Model, a list, or a factory")
    _add_redis(worker)
    _add_worker(worker)
    worker.add_argument("--block-timeout-s", type=float, help="blocking pop timeout (1.0)")
    status = sub.add_parser("status", help="queues, workers, rates and latencies per model, "
                            "read from Redis")
    _add_redis(status)
    status.add_argument("--json", action="store_true", help="print JSON for scripts")
    status.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    status.add_argument("--interval-s", type=seconds_flag, default=defaults.STATUS_INTERVAL_S,
                        help=f"sampling interval for items/s ({defaults.STATUS_INTERVAL_S}; "
                             "workers publish their counters once a heartbeat)")
    _add_redis(register_config(sub))
    _add_redis(register_versions(sub))
    try:
        from redbatch.jobs.cli import register as register_jobs
    except ModuleNotFoundError:  # without the [jobs] extra: `redbatch jobs` says so
        sub.add_parser("jobs", help="batch jobs (pip install 'redbatch[jobs]')")
    else:
        register_jobs(sub)
    return parser


def _log_level(args: argparse.Namespace) -> str:
    return str(args.log_level or os.environ.get("REDBATCH_LOG_LEVEL") or defaults.LOG_LEVEL)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if v is not None}


def _serve_gateway(config: GatewayConfig, redis: RedisSettings, log_level: str,
                   stop: threading.Event | None = None) -> None:
    """Serve until a signal (or ``stop``): one process, or ``gateway_processes`` of
    them on one port; logs "listening" once it listens, and a taken port is a
    ``ConfigError``."""
    if config.gateway_processes > 1:
        from redbatch.gateway_procs import serve_processes

        serve_processes(config, redis, log_level, stop or _stop_event())
        return
    from redbatch import gateway_server

    gateway_server.serve(config, redis, stop)


class Terminated(Exception):
    """SIGTERM reached the gateway: stop cleanly."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated


def _stop_event() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def cmd_worker(args: argparse.Namespace, redis: RedisSettings) -> None:
    from redbatch.worker.loader import check_target
    from redbatch.worker.pool import Pool

    config = from_env(WorkerConfig, _overrides(args))
    check_target(args.target)  # fail here, loudly, rather than in every replica
    pool = Pool(args.target, redis, config, _log_level(args))
    stop = _stop_event()
    pool.start()
    try:
        pool.supervise(stop)
    finally:
        pool.stop()
    if pool.failure:
        raise ConfigError(pool.failure)


def cmd_gateway(args: argparse.Namespace, redis: RedisSettings) -> None:
    # uvicorn re-raises the signal that stopped it once it is done: SIGTERM's default
    # action would skip our exit path, so turn it into an exception.
    signal.signal(signal.SIGTERM, _terminated)
    config = from_env(GatewayConfig, _overrides(args))
    check_gateway(config, redis)
    _serve_gateway(config, redis, _log_level(args))


def cmd_up(args: argparse.Namespace, redis_url: str | None) -> None:
    """Ctrl-C or SIGTERM, whenever it comes, sets one event: the gateway stops, then
    the workers (no restart), then the embedded Redis (in its own session, so the
    terminal's SIGINT does not reach it before the workers returned their batches)."""
    from redbatch.embedded import start_embedded

    stop = _stop_event()
    gateway_config, entries, file_url = _up_plan(args)
    source = "--redis-url" if args.redis_url else "REDIS_URL"
    if file_url and not args.redis_url:
        redis_url, source = file_url, f"redis_url of {args.config}"
    given = _redis_settings(redis_url) if redis_url else None  # a bad URL fails first
    embedded = None if given else start_embedded()
    if given:
        log.info("using %s", source)
    try:  # (a bad REDBATCH_* setting stops the embedded Redis too)
        redis = given or RedisSettings.from_env(embedded.url if embedded else None)
        log.info("redis: %s", redis.safe_url)
        check_gateway(gateway_config, redis)  # (before any worker starts)
        if not stop.is_set():
            _declare_pipelines(args, redis)
            _up(entries, gateway_config, redis, _log_level(args), stop)
    finally:
        if embedded:
            embedded.stop()
        log.info("stopped")


Entry = tuple[str, WorkerConfig, dict[str, Any]]


def _declare_pipelines(args: argparse.Namespace, redis: RedisSettings) -> None:
    """Store the ``[[pipelines]]`` of ``-c FILE`` in Redis: the workers of their stages
    take them up from there (``redbatch.pipelines``)."""
    if not args.config:
        return
    from redbatch import configfile
    from redbatch.pipelines.definition import publish_sync
    from redbatch.redis_conn import REDIS_ERRORS, sync_client, unavailable

    declared = configfile.load(args.config).pipelines
    if declared:
        try:
            client = sync_client(redis)
            try:
                publish_sync(client, declared)
            finally:
                client.close()
        except REDIS_ERRORS as exc:
            raise unavailable(redis, exc) from exc


def _up_plan(args: argparse.Namespace) -> tuple[GatewayConfig, list[Entry], str | None]:
    """The gateway's config and the (target, worker config, knob overrides) to
    run: from flags and env, or from ``-c FILE`` (flags override the file's gateway
    and workers)."""
    flags = _overrides(args)
    if not args.config:
        return (from_env(GatewayConfig, flags),
                [(args.models or DEMO_TARGET, from_env(WorkerConfig, flags), {})], None)
    if args.models:
        raise ConfigError("--models and -c/--config do not mix: list the models in the file")
    from redbatch import configfile

    plan = configfile.load(args.config)
    gateway = from_env(GatewayConfig, flags, base=plan.gateway_values)
    entries = [(m.target, _worker_config(flags, m.worker_values, i), m.overrides)
               for i, m in enumerate(plan.models)]
    return gateway, entries, plan.redis_url


def _worker_config(flags: dict[str, Any], values: dict[str, Any], index: int) -> WorkerConfig:
    try:
        return from_env(WorkerConfig, flags, base=values)
    except ConfigError as exc:
        raise ConfigError(f"models[{index}] with the flags and environment: {exc}") from exc


def _up(entries: list[Entry], gateway_config: GatewayConfig, redis: RedisSettings,
        log_level: str, stop: threading.Event) -> None:
    """Workers (supervised) in the background, the gateway in the foreground, until
    ``stop`` (a signal, or a pool that gave up)."""
    from redbatch.worker.loader import check_target
    from redbatch.worker.pool import Pool

    for target, _, _ in entries:
        check_target(target)  # fail here, loudly, rather than in every replica
    _check_port(gateway_config)
    pools = [Pool(target, redis, config, log_level, overrides)
             for target, config, overrides in entries]
    supervisors = []
    try:
        for pool in pools:
            pool.start()
            supervisors.append(threading.Thread(target=pool.supervise, args=(stop,),
                                                daemon=True))
            supervisors[-1].start()
        _serve_gateway(gateway_config, redis, log_level, stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not skip cleanup
            signal.signal(sig, signal.SIG_IGN)
        log.info("stopping workers")
        stop.set()
        for supervisor in supervisors:
            supervisor.join(5)
        _stop_all(pools)
    _raise_failure(pools)


def _check_port(config: GatewayConfig) -> None:
    """A taken port (or an address not of this machine) is one ``ConfigError`` before
    any worker starts (a bind, closed at once: the gateway binds it again)."""
    from redbatch import gateway_server

    gateway_server.bind(config.host, config.port).close()


def _raise_failure(pools: list[Any]) -> None:
    for pool in pools:
        if pool.failure:
            raise ConfigError(pool.failure)


def _stop_all(pools: list[Any]) -> None:
    """Stop every pool at once: their grace periods run side by side, not in a row."""
    stoppers = [threading.Thread(target=pool.stop) for pool in pools]
    for thread in stoppers:
        thread.start()
    for thread in stoppers:
        thread.join()


def cmd_status(args: argparse.Namespace, redis: RedisSettings) -> int:
    from redbatch.status_view import run

    return run(redis, as_json=args.json, watch=args.watch, interval_s=args.interval_s)


def _redis_settings(url: str | None) -> RedisSettings:
    """The Redis settings (a URL that does not parse fails here, in one line); warns
    once, here, when TLS certificates go unchecked."""
    redis = RedisSettings.from_env(url)
    if tls_unverified(redis.url):
        log.warning("redis: ssl_cert_reqs=none: the server's TLS certificate is NOT "
                    "verified; anyone on the path can pose as Redis")
    return redis


def _dispatch(args: argparse.Namespace, redis_url: str | None) -> int:
    if args.command == "up":
        cmd_up(args, redis_url)
    elif args.command == "gateway":
        cmd_gateway(args, _redis_settings(redis_url))
    elif args.command == "status":
        return cmd_status(args, _redis_settings(redis_url))
    elif args.command == "config":
        return cmd_config(args, _redis_settings(redis_url))
    elif args.command == "versions":
        return cmd_versions(args, _redis_settings(redis_url))
    elif args.command == "jobs":
        from redbatch.jobs.cli import main as jobs_main

        return jobs_main(args)
    else:
        cmd_worker(args, _redis_settings(redis_url))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own flags: see redbatch/bench/run.py
        from redbatch.bench.run import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    sys.path.insert(0, os.getcwd())
    try:
        setup_logging(args.log_level)
        # (an empty REDIS_URL is unset: ``up`` starts its embedded Redis)
        return _dispatch(args, args.redis_url or os.environ.get("REDIS_URL") or None)
    except RedbatchError as exc:
        log.error("%s", exc)
        return 2
    except ModuleNotFoundError as exc:
        if (hint := missing_extra(exc)) is None:
            raise
        log.error("%s", hint)
        return 2
    except KeyboardInterrupt:
        return 130
    except Terminated:
        log.info("stopped by SIGTERM")
        return 0


if __name__ == "__main__":
    sys.exit(main())
