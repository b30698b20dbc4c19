"""The Grafana dashboard's and the autoscaling examples' queries, against a real Prometheus.

A gateway (two processes) and a worker (the demo's ``mlp`` with two priority levels,
``/metrics`` on ``--metrics-port``) serve a few seconds of predict traffic while the
``prometheus`` binary (Debian's package: scripts/test installs it) scrapes both every
second.  Then every query of compose/grafana's dashboard (its panels and its ``$model``
variable) and of deploy/k8s's autoscaling examples (the prometheus-adapter rule, as the
HPA's External metric asks for it, and any KEDA ``prometheus`` trigger) is evaluated
through Prometheus' HTTP API at the end of the traffic, with ``$model`` the served
model and ``$__rate_interval`` the traffic's span (5 s; Grafana's is 4 s at least for a
1 s scrape interval).

Each query must return data (a value that is not NaN); every metric it names must be
scraped; every label it names in a matcher or a ``by``/``without`` clause must be on
one of those metrics' series; every label its legend shows must be on its result.  A
failure lists the queries by name.  ``test_a_wrong_name_or_label_is_caught`` shows that
a misspelt metric or label fails these checks.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from redbatch.bench.mlp import W2_IN
from redbatch.embedded import free_port
from tests.conftest import ROOT, RedisServer, Spawner, redbatch_cmd, wait_http

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]  # the first test starts it all

PROMETHEUS_BIN = shutil.which("prometheus")
PROMTOOL_BIN = shutil.which("promtool")  # the same package's
DASHBOARD_FILE = ROOT / "compose/grafana/dashboards/redbatch.json"
COMPOSE_PROMETHEUS = ROOT / "compose/prometheus.yml"
PER_JOB_DISCOVERY = {"static_configs", "dns_sd_configs", "scrape_interval", "scrape_timeout"}
K8S_DIR = ROOT / "deploy/k8s"
MODEL = "mlp"  # the model of deploy/k8s's HPA and KEDA examples
WORKER_TARGET = "tests.models_for_tests:mlp_with_levels"
SCRAPE_S = 1
LOAD_S = 5
# Grafana's $__rate_interval is 4 scrape intervals at least: the traffic's span here, so
# that each rate has about 5 samples to go on however the scrapes fall.
RATE_WINDOW = f"{max(LOAD_S, 4 * SCRAPE_S)}s"
GRAFANA_VARIABLES = {"model": MODEL, "__rate_interval": RATE_WINDOW,
                     "__interval": f"{SCRAPE_S}s"}
CALLERS = 8
METRIC = re.compile(r"\bredbatch_[a-z_]+")
MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_]\w*)\s*\}\}")
GRAFANA_VARIABLE = re.compile(r"\$\{?(\w+)\}?")
LABEL_VALUES = re.compile(r"label_values\(\s*(?:(.+?)\s*,\s*)?(\w+)\s*\)")
ADAPTER_TEMPLATE = re.compile(r"<<\s*\.(\w+)\s*>>")


@dataclass(frozen=True)
class Query:
    name: str  # where it comes from, for the failure message
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Prometheus:
    """The HTTP API of the test's Prometheus; queries are evaluated at ``at``."""

    base: str
    at: float = 0.0  # 0: now

    @property
    def when(self) -> float:
        return self.at or time.time()

    def _get(self, path: str, **params: Any) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(f"{self.base}{path}", params=params, timeout=10).json()
        return body

    def query(self, expr: str) -> tuple[list[dict[str, Any]], str]:
        """(the instant vector, the error or "") of ``expr`` at ``at``."""
        body = self._get("/api/v1/query", query=expr, time=self.when)
        return body.get("data", {}).get("result", []), body.get("error", "")

    def series_names(self, match: str) -> set[str]:
        """The names of the series ``match`` selects over the minute before ``at``
        (what prometheus-adapter asks with a rule's seriesQuery)."""
        found = self._get("/api/v1/series", start=self.when - 60, end=self.when,
                          **{"match[]": match}).get("data", [])
        return {series["__name__"] for series in found}

    def label_values(self, label: str, match: str) -> list[str]:
        values: list[str] = self._get(f"/api/v1/label/{label}/values",
                                      **{"match[]": match}).get("data", [])
        return values


# --- what a query must satisfy -------------------------------------------------------


def has_value(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(r["value"][1])) for r in result)


def missing_metrics(prom: Prometheus, query: Query) -> list[str]:
    return [f"{query.name}: metric {m} is not scraped"
            for m in sorted(set(METRIC.findall(query.expr)))
            if not prom.query(f'count({{__name__="{m}"}})')[0]]


def named_labels(expr: str) -> set[str]:
    """The labels ``expr`` names in its matchers and ``by``/``without`` clauses."""
    grouped = {label.strip() for clause in GROUPING.findall(expr) for label in clause.split(",")}
    return (set(MATCHER_LABEL.findall(expr)) | grouped) - {"", "__name__"}


def missing_labels(prom: Prometheus, query: Query) -> list[str]:
    names = "|".join(sorted(set(METRIC.findall(query.expr)))) or ".+"  # any metric
    return [f"{query.name}: no series of {names} has the label {label!r}"
            for label in sorted(named_labels(query.expr))
            if not prom.query(f'count({{__name__=~"{names}", {label}!=""}})')[0]]


def legend_problems(query: Query, result: list[dict[str, Any]]) -> list[str]:
    return [f"{query.name}: the legend's {{{{{label}}}}} is not a label of the result"
            for label in LEGEND_LABEL.findall(query.legend)
            if any(label not in r["metric"] for r in result)]


def problems(prom: Prometheus, query: Query) -> list[str]:
    """What is wrong with ``query`` against the scraped series (nothing: [])."""
    result, error = prom.query(query.expr)
    if error:
        return [f"{query.name}: {error}: {query.expr}"]
    found = missing_metrics(prom, query) + missing_labels(prom, query)
    if not has_value(result):
        found.append(f"{query.name}: no data: {query.expr}")
    return found + legend_problems(query, result)


def all_problems(prom: Prometheus, queries: list[Query]) -> list[str]:
    return [p for query in queries for p in problems(prom, query)]


# --- the dashboard -------------------------------------------------------------------


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))  # a row's own panels


def grafana_expr(expr: str) -> str:
    """``expr`` with the dashboard's variables as Grafana would fill them in."""

    def value(match: re.Match[str]) -> str:
        assert match.group(1) in GRAFANA_VARIABLES, f"unknown variable {match.group(0)}"
        return GRAFANA_VARIABLES[match.group(1)]

    return GRAFANA_VARIABLE.sub(value, expr)


def dashboard_queries(board: dict[str, Any]) -> list[Query]:
    return [Query(f"dashboard {panel['title']!r} {target.get('refId', '')}".rstrip(),
                  grafana_expr(target["expr"]), target.get("legendFormat", ""))
            for panel in panels(board["panels"]) for target in panel.get("targets", [])]


def variable_problems(prom: Prometheus, board: dict[str, Any]) -> list[str]:
    """Each ``label_values(...)`` variable must offer the served model."""
    found = []
    for variable in board.get("templating", {}).get("list", []):
        definition = variable.get("definition", "")
        match = LABEL_VALUES.fullmatch(definition.strip())
        assert match, f"variable {variable['name']}: not label_values(...): {definition!r}"
        values = prom.label_values(match.group(2), match.group(1) or "{__name__=~'.+'}")
        if MODEL not in values:
            found.append(f"variable ${variable['name']}: {definition} offers {values}")
    return found


# --- the autoscaling examples --------------------------------------------------------


def k8s_documents() -> list[dict[str, Any]]:
    return [doc for path in sorted(K8S_DIR.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def adapter_rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """prometheus-adapter's rules, from the ConfigMaps that hold its configuration."""
    configs = [yaml.safe_load(text) for doc in docs if doc["kind"] == "ConfigMap"
               for text in doc.get("data", {}).values()]
    return [rule for config in configs for key in ("rules", "externalRules")
            for rule in config.get(key, [])]


def external_metrics(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(HPA name, its metric: name and selector) for each External metric of an HPA."""
    found = []
    for doc in docs:
        if doc["kind"] != "HorizontalPodAutoscaler":
            continue
        for spec in doc["spec"].get("metrics", []):
            assert spec["type"] in {"External", "Resource"}, \
                f"{doc['metadata']['name']}: a {spec['type']} metric is not checked here"
            if spec["type"] == "External":
                found.append((doc["metadata"]["name"], spec["external"]["metric"]))
    return found


def served_name(rule: dict[str, Any], series: str) -> str | None:
    """The metric name under which ``rule`` serves ``series`` (None: it does not)."""
    naming = rule.get("name", {})
    pattern = naming.get("matches", "^(.*)$")
    if not re.search(pattern, series):
        return None
    return re.sub(pattern, naming.get("as", "$1").replace("$", "\\"), series)


def adapter_query(prom: Prometheus, rule: dict[str, Any], hpa: str,
                  metric: dict[str, Any]) -> Query | None:
    """The PromQL the adapter runs for an HPA's External ``metric`` (None: not this
    rule's metric)."""
    series = [s for s in sorted(prom.series_names(rule["seriesQuery"]))
              if served_name(rule, s) == metric["name"]]
    if not series:
        return None
    selector = metric.get("selector", {}).get("matchLabels", {})
    fill = {"Series": series[0], "GroupBy": ",".join(selector),
            "LabelMatchers": ",".join(f'{k}="{v}"' for k, v in selector.items())}
    return Query(f"HPA {hpa} {metric['name']} (adapter metricsQuery)",
                 ADAPTER_TEMPLATE.sub(lambda m: fill[m.group(1)], rule["metricsQuery"]))


def autoscaling_problems(prom: Prometheus, docs: list[dict[str, Any]]) -> list[str]:
    rules = adapter_rules(docs)
    queries = [Query(f"adapter seriesQuery {r['seriesQuery']}", r["seriesQuery"])
               for r in rules] + keda_queries(docs)
    found = []
    for hpa, metric in external_metrics(docs):
        served = [q for r in rules if (q := adapter_query(prom, r, hpa, metric))]
        queries += served
        if not served:
            found.append(f"HPA {hpa}: no adapter rule serves {metric['name']}")
    return found + all_problems(prom, queries)


def keda_queries(docs: list[dict[str, Any]]) -> list[Query]:
    return [Query(f"KEDA {doc['metadata']['name']} trigger", trigger["metadata"]["query"])
            for doc in docs if doc["kind"] == "ScaledObject"
            for trigger in doc["spec"]["triggers"] if trigger["type"] == "prometheus"]


# --- the stack, the traffic and Prometheus -------------------------------------------


def prometheus_config(targets: dict[str, int]) -> str:
    """compose/prometheus.yml's jobs of the gateway and the workers, each scraping its
    local port (``targets``: job -> port) every ``SCRAPE_S``."""
    compose = yaml.safe_load(COMPOSE_PROMETHEUS.read_text())
    jobs = [{**{k: v for k, v in job.items() if k not in PER_JOB_DISCOVERY},
             "static_configs": [{"targets": [f"127.0.0.1:{targets[job['job_name']]}"]}]}
            for job in compose["scrape_configs"] if job["job_name"] in targets]
    assert sorted(job["job_name"] for job in jobs) == sorted(targets), jobs
    interval = f"{SCRAPE_S}s"
    timing = {"scrape_interval": interval, "scrape_timeout": interval,
              "evaluation_interval": interval}
    return yaml.safe_dump({"global": {**compose["global"], **timing},
                           "scrape_configs": jobs})


def start_prometheus(spawn: Spawner, workdir: Path, targets: dict[str, int]) -> Prometheus:
    assert PROMETHEUS_BIN
    config, port = workdir / "prometheus.yml", free_port()
    config.write_text(prometheus_config(targets))
    proc = spawn([PROMETHEUS_BIN, f"--config.file={config}",
                  f"--storage.tsdb.path={workdir / 'data'}",
                  f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                 name="prometheus")
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/-/ready", 30, proc)
    return Prometheus(base)


def start_stack(spawn: Spawner, redis_url: str, ports: dict[str, int]) -> None:
    """A worker and a gateway, /metrics on ``ports`` (by Prometheus job)."""
    worker_port, gateway_port = ports["redbatch-worker"], ports["redbatch-gateway"]
    worker = spawn(redbatch_cmd("worker", WORKER_TARGET, "--redis-url", redis_url,
                                "--device", "cpu", "--threads", "1",
                                "--metrics-port", str(worker_port)), name="worker")
    gateway = spawn(redbatch_cmd("gateway", "--redis-url", redis_url,
                                 "--port", str(gateway_port)), name="gateway")
    wait_http(f"http://127.0.0.1:{gateway_port}/readyz", 60, gateway)
    wait_http(f"http://127.0.0.1:{worker_port}/metrics", 30, worker)


async def drive(base: str, seconds: float) -> collections.Counter[int]:
    """``CALLERS`` callers (both priority levels) predicting for ``seconds``."""
    body = {"x": [i / W2_IN for i in range(W2_IN)]}
    statuses: collections.Counter[int] = collections.Counter()
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        async def caller(level: int) -> None:
            while time.monotonic() < deadline:
                resp = await http.post(f"/v1/models/{MODEL}/predict", json=body,
                                       headers={"X-Redbatch-Priority": str(level)})
                statuses[resp.status_code] += 1

        await asyncio.gather(*(caller(1 + i % 2) for i in range(CALLERS)))
    return statuses


def wait_scraped_since(prom: Prometheus, since: float, targets: int,
                       timeout_s: float = 15.0) -> None:
    """Until each of the ``targets`` is up and was last scraped after ``since``
    (Prometheus applies its targets a few seconds after it starts)."""
    deadline = time.monotonic() + timeout_s
    expr = f"min(timestamp(up)) > {since} and on() count(up == 1) == {targets}"
    while not prom.query(expr)[0]:
        assert time.monotonic() < deadline, \
            httpx.get(f"{prom.base}/api/v1/targets", timeout=5).text
        time.sleep(0.1)


@pytest.fixture(scope="module")
def scraped(redis_server_factory: Callable[[], RedisServer],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """Prometheus, once the stack has served ``LOAD_S`` of traffic; queries at its end."""
    if PROMETHEUS_BIN is None:
        pytest.skip("the prometheus binary is not installed (scripts/test installs "
                    "Debian's package with apt-get when run as root)")
    workdir = tmp_path_factory.mktemp("prometheus")
    spawn = Spawner(workdir)
    ports = {"redbatch-gateway": free_port(), "redbatch-worker": free_port()}
    try:
        prom = start_prometheus(spawn, workdir, ports)  # first: it starts slowly
        start_stack(spawn, redis_server_factory().url, ports)
        wait_scraped_since(prom, time.time(), len(ports))
        statuses = asyncio.run(drive(f"http://127.0.0.1:{ports['redbatch-gateway']}",
                                     LOAD_S))
        end = time.time()
        assert set(statuses) == {200}, statuses
        wait_scraped_since(prom, end, len(ports))
        yield replace(prom, at=end)
    finally:
        spawn.stop()


def test_every_dashboard_query_returns_data(scraped: Prometheus) -> None:
    board = json.loads(DASHBOARD_FILE.read_text())
    queries = dashboard_queries(board)
    assert len(queries) >= 15, [q.name for q in queries]  # every panel's targets read
    found = variable_problems(scraped, board) + all_problems(scraped, queries)
    assert not found, "\n".join(found)


def test_every_autoscaling_query_returns_data(scraped: Prometheus) -> None:
    docs = k8s_documents()
    assert external_metrics(docs) and adapter_rules(docs)  # what there is to evaluate
    found = autoscaling_problems(scraped, docs)
    assert not found, "\n".join(found)


def misspell(old: str, new: str, field: str = "expr") -> Callable[[Query], Query]:
    return lambda q: replace(q, **{field: getattr(q, field).replace(old, new)})


MUTATIONS = {  # a correct dashboard query -> the same with one name misspelt
    "metric": misspell("redbatch_requests_total", "redbatch_request_total"),
    "matcher label": misspell('model=~"', 'models=~"'),
    "grouping label": misspell("by (model, outcome)", "by (model, outcomes)"),
    "legend label": misspell("{{outcome}}", "{{outcomes}}", "legend"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_wrong_name_or_label_is_caught(scraped: Prometheus, mutation: str) -> None:
    [right] = [q for q in dashboard_queries(json.loads(DASHBOARD_FILE.read_text()))
               if q.name == "dashboard 'Throughput by outcome' A"]
    wrong = MUTATIONS[mutation](right)
    assert wrong != right
    assert not problems(scraped, right)
    assert problems(scraped, wrong)


def test_an_hpa_metric_no_rule_serves_is_caught(scraped: Prometheus) -> None:
    docs = k8s_documents()
    for doc in docs:
        if doc["kind"] == "HorizontalPodAutoscaler":
            doc["spec"]["metrics"][0]["external"]["metric"]["name"] = "redbatch_worker_needed"
    assert "no adapter rule serves redbatch_worker_needed" in "\n".join(
        autoscaling_problems(scraped, docs))


@pytest.mark.skipif(PROMTOOL_BIN is None, reason="promtool (Debian's prometheus package, "
                    "which scripts/test installs as root) is not installed")
def test_compose_prometheus_config_passes_promtool() -> None:
    assert PROMTOOL_BIN
    checked = subprocess.run([PROMTOOL_BIN, "check", "config", str(COMPOSE_PROMETHEUS)],
                             capture_output=True, text=True, timeout=30, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
