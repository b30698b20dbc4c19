"""compose/: the docker compose deployment, checked without docker.

Docker does not run here, so these tests are what keeps compose/ honest:

1. compose/docker-compose.yml validates against the Compose Specification's JSON schema,
   with the validator of the draft the schema declares (draft-07).
   tests/data/compose-spec.json is compose-spec/compose-spec ``schema/compose-spec.json``
   (main branch), taken verbatim from the npm package dclint@3.1.0 (published
   2026-03-24; its ``schemas/compose.schema.json`` is downloaded from that repository),
   upstream sha256 46b7d35f19dd93a05f8fea530291bf84d881c1791ec167ecf0e6fb94e639d496.
   The only change is the ``$comment`` line saying so; ``test_schema_is_the_vendored_one``
   checks that.  (The docker-compose 1.29.2 wheel on PyPI carries an older copy, draft
   2019-09, from 2021: it predates keys such as ``healthcheck.start_interval``.)
   To update: replace the file with a newer upstream copy, keep the ``$comment`` line and
   put the new hash in UPSTREAM_SHA256.
2. Every ``redbatch`` command parses with the real ``build_parser()``, its worker target
   loads, and every ``REDBATCH_*`` variable is a config field; the effective configs
   (flags > env > defaults, as ``redbatch`` builds them) are valid.
3. Prometheus scrapes the ports the gateway and the workers really listen on, and every
   metrics-exporting service.
4. The Grafana dashboard queries only metrics redbatch exports; the provisioning points
   at the compose services and mounts.

Each check is a function returning a list of problems, so the negative tests can show
that a mutated copy fails it.

The metric names come from the code: ``redbatch.metrics`` (GATEWAY_METRICS,
WORKER_METRICS, series_names); ``test_metric_names_are_the_registered_collectors``
checks those lists against the collectors that module registers.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import io
import json
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from redbatch.cli import build_parser
from redbatch.config import GatewayConfig, RedisSettings, WorkerConfig, from_env
from redbatch.errors import ConfigError, RedbatchError
from redbatch.metrics import GATEWAY_METRICS, HISTOGRAMS, WORKER_METRICS, series_names

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
DOCKERFILE = COMPOSE_DIR / "Dockerfile"
PROMETHEUS_FILE = COMPOSE_DIR / "prometheus.yml"
DATASOURCES_FILE = COMPOSE_DIR / "grafana/provisioning/datasources/prometheus.yml"
PROVIDERS_FILE = COMPOSE_DIR / "grafana/provisioning/dashboards/redbatch.yml"
DASHBOARD_FILE = COMPOSE_DIR / "grafana/dashboards/redbatch.json"
SCHEMA_FILE = Path(__file__).resolve().parent / "data" / "compose-spec.json"
UPSTREAM_SHA256 = "46b7d35f19dd93a05f8fea530291bf84d881c1791ec167ecf0e6fb94e639d496"

# What the dashboard must show (docs/compose.md lists these panels): metric -> why.
REQUIRED_DASHBOARD_SERIES = {
    "redbatch_requests_total": "throughput by outcome",
    "redbatch_request_duration_seconds_bucket": "latency percentiles",
    "redbatch_batch_size_bucket": "batch-size heatmap",
    "redbatch_queue_depth": "queue depth",
    "redbatch_live_workers": "live workers",
    "redbatch_queue_wait_seconds_bucket": "queue wait p99",
    "redbatch_forward_seconds_bucket": "forward time p99",
    "redbatch_workers_needed": "workers needed against live",
    "redbatch_arrival_items_per_second": "arrival against capacity",
    "redbatch_capacity_items_per_second": "arrival against capacity",
    "redbatch_queue_depth_level": "queue depth per priority level",
}
METRIC_TOKEN = re.compile(r"redbatch_[a-z_]+")
INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}")
PROMETHEUS_PORT = 9090
Problems = list[str]


# --- reading compose ------------------------------------------------------------------


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def interpolate(value: str) -> str:
    """``${VAR:-default}`` -> default, ``${VAR}`` -> "": the host's env is not ours."""

    def sub(match: re.Match[str]) -> str:
        op, default = match.group(2) or "", match.group(3) or ""
        return default if "-" in op else ""

    return INTERPOLATION.sub(sub, value)


def command_argv(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: interpolate("" if v is None else str(v)) for k, v in env.items()}


def container_ports(service: dict[str, Any]) -> list[tuple[str | None, int]]:
    """(published, target) for each `ports:` entry, short or long syntax."""
    result: list[tuple[str | None, int]] = []
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            published = entry.get("published")
            result.append((None if published is None else str(published), int(entry["target"])))
            continue
        parts = str(entry).split("/")[0].rsplit(":", 2)
        published = parts[-2] if len(parts) > 1 else None
        result.append((published, int(parts[-1])))
    return result


def exposed_ports(service: dict[str, Any]) -> list[str]:
    """`ports:` entries published on every host interface rather than on loopback."""
    exposed = []
    for entry in service.get("ports", []):
        host_ip = (entry.get("host_ip") if isinstance(entry, dict)
                   else str(entry).rsplit(":", 2)[0] if str(entry).count(":") == 2 else None)
        if host_ip not in {"127.0.0.1", "::1", "localhost"}:
            exposed.append(str(entry))
    return exposed


def volume_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) for each `volumes:` entry, short or long syntax."""
    mounts = []
    for entry in service.get("volumes", []):
        if isinstance(entry, dict):
            mounts.append((str(entry.get("source", "")), str(entry["target"])))
        else:
            source, target = str(entry).split(":")[:2]
            mounts.append((source, target))
    return mounts


def host_path(source: str) -> Path | None:
    """A bind mount's host path (relative to the compose file); None for a named volume."""
    if source.startswith((".", "/")):
        return (COMPOSE_DIR / source).resolve()
    return None


def redbatch_services(compose: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], list[str]]]:
    for name, service in compose["services"].items():
        argv = command_argv(service)
        if argv[:1] == ["redbatch"]:
            yield name, service, argv


def parse_command(argv: list[str]) -> tuple[Any, str]:
    """Parse with the real CLI parser; (namespace, "") or (None, argparse's complaint)."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return build_parser().parse_args(argv[1:]), ""
    except SystemExit:
        return None, stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue() else "exit"


def config_classes(command: str) -> tuple[type[Any], ...]:
    return {"gateway": (GatewayConfig,), "worker": (WorkerConfig,),
            "up": (GatewayConfig, WorkerConfig)}[command]


def effective_configs(argv: list[str], env: dict[str, str]) -> dict[type[Any], Any]:
    """The configs `redbatch` builds from these flags and this environment."""
    args, _ = parse_command(argv)
    assert args is not None
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    configs: dict[type[Any], Any] = {
        cls: from_env(cls, overrides, env) for cls in config_classes(args.command)}
    configs[RedisSettings] = RedisSettings.from_env(args.redis_url, env)
    return configs


def listening_ports(argv: list[str], env: dict[str, str]) -> set[int]:
    """Ports a redbatch container serves HTTP on: the gateway's, or the worker replicas'
    /metrics (replica i on metrics_port + i)."""
    configs = effective_configs(argv, env)
    ports: set[int] = set()
    if GatewayConfig in configs:
        ports.add(configs[GatewayConfig].port)
    worker = configs.get(WorkerConfig)
    if worker is not None and worker.metrics_port:
        ports.update(worker.metrics_port + i for i in range(worker.replicas))
    return ports


def service_ports(compose: dict[str, Any]) -> dict[str, set[int]]:
    ports = {name: listening_ports(argv, environment(service))
             for name, service, argv in redbatch_services(compose)}
    ports["prometheus"] = {PROMETHEUS_PORT}
    return ports


def healthcheck_ports(service: dict[str, Any]) -> set[int]:
    test = service.get("healthcheck", {}).get("test", [])
    text = test if isinstance(test, str) else " ".join(test)
    return {int(port) for port in re.findall(r"https?://[^/:'\"\s]+:(\d+)", text)}


# --- the checks: each returns a list of problems ---------------------------------------


def schema_validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    """The validator of the draft the schema declares.  compose-spec spells draft-07
    ``https://json-schema.org/draft-07/schema``, which jsonschema's lookup (keyed on
    ``http://...#``) does not know, so the draft is read off the URI."""
    declared = str(schema.get("$schema", ""))
    drafts = {"draft-07": jsonschema.Draft7Validator,
              "draft/2019-09": jsonschema.Draft201909Validator,
              "draft/2020-12": jsonschema.Draft202012Validator}
    cls = next((v for key, v in drafts.items() if f"json-schema.org/{key}/" in declared + "/"),
               None)
    assert cls is not None, f"unknown $schema {declared!r}"
    cls.check_schema(schema)
    return cls(schema)


def schema_problems(compose: dict[str, Any], schema: dict[str, Any]) -> Problems:
    validator = schema_validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in validator.iter_errors(compose)]


def command_problems(compose: dict[str, Any]) -> Problems:
    from redbatch.worker.loader import load_models

    problems = []
    for name, _service, argv in redbatch_services(compose):
        args, complaint = parse_command(argv)
        if args is None:
            problems.append(f"{name}: {shlex.join(argv)!r} does not parse: {complaint}")
            continue
        for target in (getattr(args, "target", None), getattr(args, "models", None)):
            if target is None:
                continue
            try:
                load_models(target)
            except RedbatchError as exc:
                problems.append(f"{name}: worker target {target!r}: {exc}")
    return problems


def env_problems(compose: dict[str, Any]) -> Problems:
    problems = []
    for name, service, argv in redbatch_services(compose):
        env = environment(service)
        args, _ = parse_command(argv)
        if args is None:
            problems.append(f"{name}: command does not parse")
            continue
        classes = (*config_classes(args.command), RedisSettings)
        known = {"REDBATCH_" + f.name.upper() for cls in classes for f in dataclasses.fields(cls)}
        for var in env:
            if var.startswith("REDBATCH_") and var not in known:
                problems.append(f"{name}: {var} is not a field of "
                                f"{'/'.join(c.__name__ for c in classes)}")
        if "REDIS_URL" not in env:
            problems.append(f"{name}: REDIS_URL is not set")
        try:
            effective_configs(argv, env)
        except ConfigError as exc:
            problems.append(f"{name}: invalid configuration: {exc}")
    return problems


def scrape_targets(prometheus: dict[str, Any]) -> Iterator[tuple[str, str, int]]:
    """(job, host or DNS name, port) for every static and DNS target."""
    for job in prometheus.get("scrape_configs", []):
        for static in job.get("static_configs", []):
            for target in static.get("targets", []):
                host, _, port = str(target).rpartition(":")
                yield job["job_name"], host, int(port)
        for dns in job.get("dns_sd_configs", []):
            for dns_name in dns.get("names", []):
                yield job["job_name"], dns_name, int(dns.get("port", 0))


def prometheus_problems(compose: dict[str, Any], prometheus: dict[str, Any]) -> Problems:
    problems = []
    ports = service_ports(compose)
    scraped: dict[str, set[int]] = {}
    for job, host, port in scrape_targets(prometheus):
        if host == "localhost" and port == PROMETHEUS_PORT:
            continue  # Prometheus itself
        if host not in compose["services"]:
            problems.append(f"job {job}: {host} is not a compose service")
        elif port not in ports.get(host, set()):
            problems.append(f"job {job}: {host} does not listen on {port} "
                            f"(it serves {sorted(ports.get(host, set()))})")
        scraped.setdefault(host, set()).add(port)
    for name, _service, _argv in redbatch_services(compose):
        missing = ports[name] - scraped.get(name, set())
        if missing:
            problems.append(f"{name} serves /metrics on {sorted(missing)}, not scraped")
    return problems


def service_problems(compose: dict[str, Any]) -> Problems:
    """Ports, healthchecks and scaling of the redbatch services themselves."""
    problems = []
    for name, service, argv in redbatch_services(compose):
        ports = listening_ports(argv, environment(service))
        for published, target in container_ports(service):
            if target not in ports:
                problems.append(f"{name}: publishes container port {target}, serves {ports}")
            if published is not None and args_command(argv) == "worker":
                problems.append(f"{name}: a fixed host port stops `--scale {name}=N`")
        if not healthcheck_ports(service) <= ports:
            problems.append(f"{name}: healthcheck probes {healthcheck_ports(service)}, "
                            f"serves {ports}")
        if args_command(argv) == "worker" and "container_name" in service:
            problems.append(f"{name}: container_name stops `--scale {name}=N`")
    gateway = compose["services"]["gateway"]
    if not any(target == 8000 for _, target in container_ports(gateway)):
        problems.append("gateway: port 8000 is not published")
    return problems


def args_command(argv: list[str]) -> str | None:
    args, _ = parse_command(argv)
    return None if args is None else str(args.command)


def duration_s(text: str) -> float:
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    assert parts, text
    return sum(float(value) * units[unit] for value, unit in parts)


def all_panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside rows included."""
    for panel in items:
        yield panel
        yield from all_panels(panel.get("panels", []))


def dashboard_exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and query variable."""
    for panel in all_panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            yield f"panel {panel.get('title')!r}", str(target.get("expr", ""))
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query", "")
        if isinstance(query, dict):
            query = query.get("query", "")
        yield f"variable {variable.get('name')!r}", str(query)


def dashboard_problems(dashboard: dict[str, Any], datasource_uids: set[str]) -> Problems:
    problems = metric_name_problems(dashboard) + panel_problems(dashboard)
    for uid in _datasource_uids(dashboard):
        if uid not in datasource_uids:
            problems.append(f"datasource uid {uid!r} is not provisioned ({datasource_uids})")
    return problems


def metric_name_problems(dashboard: dict[str, Any]) -> Problems:
    """Every ``redbatch_*`` token in a query is a series redbatch exports."""
    exported = series_names()
    return [f"{where}: {token} is not a series redbatch exports"
            for where, expr in dashboard_exprs(dashboard)
            for token in METRIC_TOKEN.findall(expr) if token not in exported]


def panel_problems(dashboard: dict[str, Any]) -> Problems:
    """The panels the deployment promises are there."""
    used = {token for _, expr in dashboard_exprs(dashboard)
            for token in METRIC_TOKEN.findall(expr)}
    problems = [f"no panel queries {series} ({why})"
                for series, why in REQUIRED_DASHBOARD_SERIES.items() if series not in used]
    exprs = ";".join(expr for _, expr in dashboard_exprs(dashboard))
    for q in ("0.5", "0.9", "0.99"):
        if not re.search(rf"histogram_quantile\({re.escape(q)},[^;]*"
                         r"redbatch_request_duration_seconds_bucket", exprs):
            problems.append(f"no p{q[2:]:0<2} latency from redbatch_request_duration_seconds")
    if not any(p.get("type") == "heatmap" and "redbatch_batch_size_bucket" in json.dumps(p)
               for p in all_panels(dashboard.get("panels", []))):
        problems.append("no heatmap panel over redbatch_batch_size_bucket")
    return problems


def _datasource_uids(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ds = node.get("datasource")
        if isinstance(ds, dict) and "uid" in ds:
            yield str(ds["uid"])
        for value in node.values():
            yield from _datasource_uids(value)
    elif isinstance(node, list):
        for value in node:
            yield from _datasource_uids(value)


def grafana_problems(compose: dict[str, Any], datasources: dict[str, Any],
                     providers: dict[str, Any]) -> Problems:
    mounts = volume_mounts(compose["services"]["grafana"])
    problems = datasource_problems(compose, datasources) + provider_problems(mounts, providers)
    provisioning = {target: host_path(source) for source, target in mounts}
    if provisioning.get("/etc/grafana/provisioning") != DATASOURCES_FILE.parent.parent:
        problems.append("grafana: compose/grafana/provisioning is not mounted at "
                        "/etc/grafana/provisioning")
    return problems


def datasource_problems(compose: dict[str, Any], datasources: dict[str, Any]) -> Problems:
    """Each Prometheus datasource points at the compose prometheus service and port."""
    problems = []
    for ds in datasources.get("datasources", []):
        if ds.get("type") != "prometheus":
            continue
        url = urlsplit(ds.get("url", ""))
        prometheus = compose["services"].get(url.hostname or "")
        if prometheus is None or "prometheus" not in str(prometheus.get("image", "")):
            problems.append(f"datasource url {ds.get('url')!r}: no prometheus service there")
        elif url.port != PROMETHEUS_PORT:
            problems.append(f"datasource url {ds.get('url')!r}: Prometheus listens on "
                            f"{PROMETHEUS_PORT}")
    return problems


def provider_problems(mounts: list[tuple[str, str]], providers: dict[str, Any]) -> Problems:
    """Each file provider's path is bind-mounted from a folder holding the dashboard."""
    problems = []
    for provider in providers.get("providers", []):
        path = PurePosixPath(provider.get("options", {}).get("path", ""))
        mount = next(((source, PurePosixPath(target)) for source, target in mounts
                      if path == PurePosixPath(target) or PurePosixPath(target) in path.parents),
                     None)
        host = None if mount is None else host_path(mount[0])
        if mount is None or host is None:
            problems.append(f"provider {provider.get('name')!r}: {path} is not bind-mounted")
            continue
        inside = host / path.relative_to(mount[1])
        if not (inside / DASHBOARD_FILE.name).is_file():
            problems.append(f"provider {provider.get('name')!r}: {path} ({inside}) holds no "
                            f"{DASHBOARD_FILE.name}")
    return problems


def dockerfile_problems(text: str) -> Problems:
    problems = []
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and not line.strip().startswith("#")]
    froms = [line.split()[1] for line in lines if line.upper().startswith("FROM ")]
    if not froms or froms[-1] != "python:3.11-slim":
        problems.append(f"final image is {froms[-1:]}, not python:3.11-slim")
    if "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" not in lines:
        problems.append("no ARG TORCH_INDEX_URL defaulting to the CPU wheel index")
    torch_line = next((line for line in lines if '"torch==' in line or " torch==" in line), "")
    if "torch==2.13.0" not in torch_line or "${TORCH_INDEX_URL}" not in torch_line:
        problems.append("torch==2.13.0 is not installed from ${TORCH_INDEX_URL}")
    users = [line.split()[1] for line in lines if line.upper().startswith("USER ")]
    if not users or users[-1].split(":")[0] in {"root", "0"}:
        problems.append(f"runs as {users[-1:] or 'root'}")
    for line in lines:
        if re.match(r"(?i)(ENV|ARG)\s.*(PASSWORD|SECRET|TOKEN|API_KEY|REDIS_URL)", line):
            problems.append(f"secret-looking setting baked in: {line}")
    return problems + install_problems(lines)


def install_problems(lines: list[str]) -> Problems:
    """The image runs the gateway and the workers: a plain install is the producer only."""
    if any(re.search(r"pip install .*redbatch-src\[all\]", line) for line in lines):
        return []
    return ["redbatch is not installed with its [all] extra (gateway, worker, embedded)"]


# --- fixtures -------------------------------------------------------------------------


def load_dict(path: Path) -> dict[str, Any]:
    """A JSON or YAML file whose top level must be a mapping."""
    data = json.loads(path.read_text()) if path.suffix == ".json" else load_yaml(path)
    assert isinstance(data, dict), f"{path}: top level is not a mapping"
    return data


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_dict(COMPOSE_FILE)


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return load_dict(SCHEMA_FILE)


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    return load_dict(PROMETHEUS_FILE)


@pytest.fixture(scope="module")
def datasources() -> dict[str, Any]:
    return load_dict(DATASOURCES_FILE)


@pytest.fixture(scope="module")
def providers() -> dict[str, Any]:
    return load_dict(PROVIDERS_FILE)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return load_dict(DASHBOARD_FILE)


@pytest.fixture(scope="module")
def datasource_uids(datasources: dict[str, Any]) -> set[str]:
    return {str(ds["uid"]) for ds in datasources["datasources"] if "uid" in ds}


# --- 1. the compose specification -----------------------------------------------------


def test_schema_is_the_vendored_one() -> None:
    text = SCHEMA_FILE.read_text()
    upstream = "".join(line for line in text.splitlines(keepends=True)
                       if not line.startswith('  "$comment": '))
    assert hashlib.sha256(upstream.encode()).hexdigest() == UPSTREAM_SHA256
    schema = json.loads(text)
    assert schema["$schema"] == "https://json-schema.org/draft-07/schema"
    assert isinstance(schema_validator(schema), jsonschema.Draft7Validator)


def test_compose_file_matches_the_compose_spec(compose: dict[str, Any],
                                                schema: dict[str, Any]) -> None:
    assert schema_problems(compose, schema) == []
    assert "version" not in compose  # obsolete in the compose specification


def test_compose_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) >= {"redis", "gateway", "worker", "worker-cpu", "prometheus",
                             "grafana"}
    redis = services["redis"]
    assert str(redis["image"]).split(":")[0] == "redis"
    assert str(redis["image"]).split(":")[1].startswith("7")
    redis_args = command_argv(redis)
    assert redis_args[redis_args.index("--appendonly") + 1] == "yes"
    assert redis_args[redis_args.index("--maxmemory-policy") + 1] == "noeviction"
    assert "redis-cli" in " ".join(redis["healthcheck"]["test"])
    assert ("redis-data", "/data") in volume_mounts(redis)
    assert "redis-data" in compose["volumes"]
    for name in ("gateway", "worker", "worker-cpu"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        assert environment(services[name])["REDIS_URL"] == "redis://redis:6379/0"

    worker = services["worker"]
    assert worker["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "profiles" not in worker
    assert services["worker-cpu"]["profiles"] == ["cpu"]
    for name, device in (("worker", "cuda"), ("worker-cpu", "cpu")):
        argv = command_argv(services[name])
        config = effective_configs(argv, environment(services[name]))[WorkerConfig]
        assert config.device == device
        # SIGTERM waits grace_s for in-flight batches: compose must not SIGKILL sooner.
        assert duration_s(services[name]["stop_grace_period"]) > config.grace_s
    # the gateway answers what it holds for up to its longest deadline, and a margin
    from redbatch.gateway_procs import STOP_MARGIN_S

    gateway = effective_configs(command_argv(services["gateway"]),
                                environment(services["gateway"]))[GatewayConfig]
    assert duration_s(services["gateway"]["stop_grace_period"]) > \
        gateway.max_timeout_s + STOP_MARGIN_S


def test_every_published_port_is_on_localhost(compose: dict[str, Any]) -> None:
    """An empty REDBATCH_API_KEY is the default: nothing is reachable from other hosts
    until someone decides to (docs/deploy.md)."""
    for name, service in compose["services"].items():
        assert exposed_ports(service) == [], name
    assert exposed_ports({"ports": ["8000:8000", {"target": 8000, "published": 8000},
                                    "127.0.0.1:9090:9090",
                                    {"target": 1, "host_ip": "127.0.0.1"}]}) == [
        "8000:8000", "{'target': 8000, 'published': 8000}"]


def test_compose_build_uses_the_dockerfile(compose: dict[str, Any]) -> None:
    args_declared = set(re.findall(r"(?m)^ARG (\w+)", DOCKERFILE.read_text()))
    for name, service, _argv in redbatch_services(compose):
        build = service["build"]
        context = (COMPOSE_DIR / build["context"]).resolve()
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE, name
        assert (context / "pyproject.toml").is_file(), name
        assert set(build.get("args", {})) <= args_declared, name
    cuda_index = interpolate(compose["services"]["worker"]["build"]["args"]["TORCH_INDEX_URL"])
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", cuda_index)


def test_dockerfile() -> None:
    text = DOCKERFILE.read_text()
    assert dockerfile_problems(text) == []
    bootstrap = (ROOT / "scripts/_bootstrap.sh").read_text()
    assert 'TORCH_SPEC="torch==2.13.0"' in bootstrap  # the same torch as scripts/up


# --- 2. commands, flags and env vars against the code ---------------------------------


def test_commands_parse_with_the_real_cli(compose: dict[str, Any]) -> None:
    names = [name for name, _, _ in redbatch_services(compose)]
    assert sorted(names) == ["gateway", "worker", "worker-cpu"]
    assert command_problems(compose) == []


def test_env_vars_are_config_fields(compose: dict[str, Any]) -> None:
    assert env_problems(compose) == []


def test_redbatch_services_ports_and_healthchecks(compose: dict[str, Any]) -> None:
    assert service_problems(compose) == []
    ports = service_ports(compose)
    assert ports["gateway"] == {8000}
    assert ports["worker"] == ports["worker-cpu"] == {9100}


# --- 3./4. Prometheus -----------------------------------------------------------------


def test_prometheus_scrapes_every_service_on_its_port(compose: dict[str, Any],
                                                      prometheus: dict[str, Any]) -> None:
    assert prometheus_problems(compose, prometheus) == []
    targets = {(host, port) for _, host, port in scrape_targets(prometheus)}
    assert {("gateway", 8000), ("worker", 9100), ("worker-cpu", 9100)} <= targets
    for job in prometheus["scrape_configs"]:
        for dns in job.get("dns_sd_configs", []):
            assert dns["type"] == "A"  # compose DNS: one A record per replica
            assert not any(n.startswith("tasks.") for n in dns["names"])  # swarm-only
        assert job.get("metrics_path", "/metrics") == "/metrics"


def test_prometheus_config_is_mounted(compose: dict[str, Any]) -> None:
    service = compose["services"]["prometheus"]
    assert str(service["image"]).startswith("prom/prometheus")
    config_flags = [a for a in command_argv(service) if a.startswith("--config.file=")]
    config_path = config_flags[0].split("=", 1)[1] if config_flags else (
        "/etc/prometheus/prometheus.yml")
    assert (str(PROMETHEUS_FILE), config_path) in [
        (str(host_path(source)), target) for source, target in volume_mounts(service)]


# --- 3. Grafana -----------------------------------------------------------------------


def test_dashboard_queries_only_exported_metrics(dashboard: dict[str, Any],
                                                 datasource_uids: set[str]) -> None:
    assert dashboard_problems(dashboard, datasource_uids) == []
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_grafana_provisioning_matches_the_mounts(compose: dict[str, Any],
                                                 datasources: dict[str, Any],
                                                 providers: dict[str, Any]) -> None:
    assert grafana_problems(compose, datasources, providers) == []
    assert [p["type"] for p in providers["providers"]] == ["file"]


def test_metric_names_are_the_registered_collectors() -> None:
    """The names the dashboard is checked against are the collectors redbatch registers,
    with the kinds the dashboard assumes (histogram_quantile over ``_bucket``, rate of
    ``_total``)."""
    from prometheus_client.metrics import MetricWrapperBase

    from redbatch import metrics

    registered: dict[str, str] = {}
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase):
            for family in obj.describe():
                suffix = "_total" if family.type == "counter" else ""
                registered[family.name + suffix] = family.type
    names = (*GATEWAY_METRICS, *WORKER_METRICS)
    assert len(set(names)) == len(names)
    assert set(names) == set(registered)
    for name in names:
        expected = ("histogram" if name in HISTOGRAMS
                    else "counter" if name.endswith("_total") else "gauge")
        assert registered[name] == expected, name
    assert "redbatch_requests_total" in GATEWAY_METRICS
    assert {"redbatch_batch_size", "redbatch_forward_seconds",
            "redbatch_queue_wait_seconds"} <= set(WORKER_METRICS) & HISTOGRAMS


# --- every check can fail -------------------------------------------------------------


Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mutation:
    def mutate(data: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        node: Any = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return mutate


def _append_flag(service: str, *flags: str) -> Mutation:
    def mutate(data: dict[str, Any]) -> None:
        data["services"][service]["command"] = [*data["services"][service]["command"], *flags]
    return mutate


def _env(service: str, name: str, value: str) -> Mutation:
    def mutate(data: dict[str, Any]) -> None:
        data["services"][service]["environment"] = {
            **data["services"][service]["environment"], name: value}
    return mutate


@pytest.mark.parametrize("mutate", [
    _set("services/gateway/bogus_key", 1),
    _set("services/worker/deploy/resources/reservations/devices/0/capabilities", "gpu"),
    _set("services/redis/healthcheck/interval", 5),
], ids=["unknown-key", "capabilities-not-a-list", "interval-not-a-string"])
def test_schema_check_can_fail(compose: dict[str, Any], schema: dict[str, Any],
                               mutate: Mutation) -> None:
    broken = copy.deepcopy(compose)
    mutate(broken)
    assert schema_problems(broken, schema)


@pytest.mark.parametrize("mutate", [
    _append_flag("worker", "--bogus-flag"),
    _append_flag("gateway", "--metrics-port", "9100"),  # a worker flag on the gateway
    _set("services/worker-cpu/command/2", "redbatch.demo:no_such_models"),
    _set("services/gateway/command/1", "serve"),
], ids=["bogus-flag", "worker-flag-on-gateway", "missing-target", "unknown-subcommand"])
def test_command_check_can_fail(compose: dict[str, Any], mutate: Mutation) -> None:
    broken = copy.deepcopy(compose)
    mutate(broken)
    assert command_problems(broken)


@pytest.mark.parametrize("mutate", [
    _env("worker", "REDBATCH_NOT_A_FIELD", "1"),
    _env("gateway", "REDBATCH_REPLICAS", "2"),  # a worker field on the gateway
    _env("worker", "REDBATCH_LEASE_TTL_S", "1"),  # must exceed 2 x heartbeat_interval_s
    _env("worker-cpu", "REDBATCH_THREADS", "two"),
    _env("gateway", "REDIS_URL", "http://redis:6379"),
], ids=["unknown-var", "worker-var-on-gateway", "invalid-lease", "not-an-int",
        "invalid-redis-url"])
def test_env_check_can_fail(compose: dict[str, Any], mutate: Mutation) -> None:
    broken = copy.deepcopy(compose)
    mutate(broken)
    assert env_problems(broken)


@pytest.mark.parametrize(("compose_mutation", "prometheus_mutation"), [
    (None, _set("scrape_configs/1/dns_sd_configs/0/port", 9101)),
    (None, _set("scrape_configs/0/static_configs/0/targets", ["gateway:8080"])),
    (None, _set("scrape_configs/2/dns_sd_configs/0/names", ["worker_cpu"])),
    (_set("services/worker/command/6", "9200"), None),
    (_env("worker-cpu", "REDBATCH_REPLICAS", "2"), None),  # /metrics on 9100 and 9101
], ids=["worker-port", "gateway-port", "unknown-service", "metrics-port-moved",
        "replica-port-unscraped"])
def test_prometheus_check_can_fail(compose: dict[str, Any], prometheus: dict[str, Any],
                                   compose_mutation: Mutation | None,
                                   prometheus_mutation: Mutation | None) -> None:
    broken_compose, broken_prometheus = copy.deepcopy(compose), copy.deepcopy(prometheus)
    if compose_mutation:
        compose_mutation(broken_compose)
    if prometheus_mutation:
        prometheus_mutation(broken_prometheus)
    assert prometheus_problems(broken_compose, broken_prometheus)


@pytest.mark.parametrize("mutate", [
    _set("services/worker/ports", ["9100:9100"]),
    _set("services/worker/container_name", "redbatch-worker"),
    _set("services/gateway/ports", ["8000:8080"]),
    _set("services/gateway/healthcheck/test",
         ["CMD", "python", "-c", "urlopen('http://127.0.0.1:8080/healthz')"]),
], ids=["worker-host-port", "worker-container-name", "gateway-target-port",
        "gateway-healthcheck-port"])
def test_service_check_can_fail(compose: dict[str, Any], mutate: Mutation) -> None:
    broken = copy.deepcopy(compose)
    mutate(broken)
    assert service_problems(broken)


@pytest.mark.parametrize(("old", "new"), [
    ("redbatch_request_duration_seconds_bucket", "redbatch_request_latency_seconds_bucket"),
    ("redbatch_requests_total", "redbatch_requests_total_bucket"),  # a counter has no buckets
    ("redbatch_queue_depth", "redbatch_queue_length"),
    ('"uid": "prometheus"', '"uid": "prom"'),
    ('"type": "heatmap"', '"type": "timeseries"'),
    ("histogram_quantile(0.9,", "histogram_quantile(0.95,"),
], ids=["unknown-histogram", "suffix-on-counter", "unknown-gauge", "datasource-uid",
        "no-heatmap", "no-p90"])
def test_dashboard_check_can_fail(dashboard: dict[str, Any], datasource_uids: set[str],
                                  old: str, new: str) -> None:
    text = json.dumps(dashboard)
    assert old in text
    assert dashboard_problems(json.loads(text.replace(old, new)), datasource_uids)


@pytest.mark.parametrize(("target", "mutate"), [
    ("datasources", _set("datasources/0/url", "http://prom:9090")),
    ("datasources", _set("datasources/0/url", "http://prometheus:9091")),
    ("providers", _set("providers/0/options/path", "/var/lib/grafana/dashboards")),
    ("compose", _set("services/grafana/volumes/1", "./grafana:/etc/grafana/dashboards:ro")),
], ids=["datasource-host", "datasource-port", "provider-path", "dashboards-mount"])
def test_grafana_check_can_fail(compose: dict[str, Any], datasources: dict[str, Any],
                                providers: dict[str, Any], target: str,
                                mutate: Mutation) -> None:
    data = {"compose": compose, "datasources": datasources, "providers": providers}
    data = {key: copy.deepcopy(value) for key, value in data.items()}
    mutate(data[target])
    assert grafana_problems(data["compose"], data["datasources"], data["providers"])


@pytest.mark.parametrize(("old", "new"), [
    ("USER redbatch", "USER root"),
    ("FROM python:3.11-slim", "FROM python:3.11"),
    ("torch==2.13.0", "torch"),
    ("ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu",
     "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130"),
    ("ENV PYTHONDONTWRITEBYTECODE=1", "ENV REDBATCH_API_KEY=hunter2 PYTHONDONTWRITEBYTECODE=1"),
    ('"/tmp/redbatch-src[all]"', "/tmp/redbatch-src"),
], ids=["root", "not-slim", "torch-unpinned", "cuda-default", "secret", "core-only"])
def test_dockerfile_check_can_fail(old: str, new: str) -> None:
    text = DOCKERFILE.read_text()
    assert old in text
    assert dockerfile_problems(text.replace(old, new))
