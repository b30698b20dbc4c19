"""deploy/k8s/: the Kubernetes examples, checked without a cluster.

1. Every manifest of a built-in kind validates, strictly (no unknown fields), against
   the Kubernetes JSON schemas that the PyPI package ``kubernetes-validate`` ships.
2. KEDA's ScaledObject is a CRD those schemas do not know: its structure is checked
   here (apiVersion, the worker Deployment as its target, and each trigger: a Redis
   Lists trigger's list is a model's queue key as ``redbatch.protocol`` spells it; a
   Prometheus trigger's query takes the largest over the gateways of a fleet-wide
   gauge that they export, for a served model).  tests/test_prometheus.py evaluates
   the Prometheus triggers' queries against a real Prometheus.
3. The containers run real ``redbatch`` commands (the CLI's parser), read real
   ``REDBATCH_*`` variables (config fields), listen where their ports and probes say,
   and probe real routes; the workers request a GPU.
4. The HPA and the prometheus-adapter rule name the metric the gateway exports
   (``redbatch.metrics.WORKERS_NEEDED_NAME``).

Each check returns a list of problems, so that the negative tests can show that a
mutated copy fails it.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from redbatch import protocol
from redbatch.config import RedisSettings
from redbatch.metrics import GATEWAY_METRICS, SCALING_METRICS, WORKERS_NEEDED_NAME
from redbatch.worker.loader import load_models
from tests.test_compose import config_classes, listening_ports, parse_command

K8S_DIR = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the examples are meant for
KEDA_API = "keda.sh/v1alpha1"
KEDA_TRIGGERS = {"redis": "address", "redis-cluster": "addresses"}  # -> where Redis is
PROMETHEUS_TRIGGER = "prometheus"  # KEDA's Prometheus scaler
# The gauges every gateway exports with the same fleet-wide value (read from Redis at
# scrape time): a trigger takes the largest over the gateways, as a sum would count it
# once per gateway.
FLEET_GAUGES = frozenset({"redbatch_queue_depth", *SCALING_METRICS}) & set(GATEWAY_METRICS)
FLEET_QUERY = re.compile(r'max\s*\(\s*(redbatch_[a-z_]+)\s*\{\s*model\s*=\s*"([^"]+)"\s*\}\s*\)')
ROUTES = {"gateway": {"/healthz", "/readyz", "/metrics"}, "worker": {"/metrics"}}
PLACEHOLDERS = {"REDIS_URL": "redis://redis:6379/0"}  # for variables read from Secrets
Problems = list[str]


def documents() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in sorted(K8S_DIR.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _name, doc in documents() if doc["kind"] == kind]


def deployment(component: str) -> dict[str, Any]:
    found = [d for d in of_kind("Deployment")
             if d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    assert len(found) == 1, component
    return found[0]


def container(doc: dict[str, Any]) -> dict[str, Any]:
    containers = doc["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def env_of(spec: dict[str, Any]) -> dict[str, str]:
    """The container's variables; those read from a Secret get a placeholder value."""
    return {e["name"]: str(e.get("value", PLACEHOLDERS.get(e["name"], "")))
            for e in spec.get("env", [])}


def served_models(doc: dict[str, Any]) -> set[str]:
    args, _ = parse_command(container(doc)["command"])
    return {m.name for m in load_models(args.target)}


# --- the checks: each returns a list of problems ---------------------------------------


def schema_problems(doc: dict[str, Any]) -> Problems:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{doc['kind']}/{doc['metadata']['name']}: {exc.message}"]
    return []


def command_problems(doc: dict[str, Any], component: str) -> Problems:
    spec = container(doc)
    args, complaint = parse_command(spec["command"])
    if args is None or args.command != component:
        return [f"{component}: {spec['command']} is not `redbatch {component}`: {complaint}"]
    env = env_of(spec)
    classes = (*config_classes(args.command), RedisSettings)
    known = {"REDBATCH_" + f.name.upper() for cls in classes for f in dataclasses.fields(cls)}
    problems = [f"{component}: {var} is no config field" for var in env
                if var.startswith("REDBATCH_") and var not in known]
    return problems + ([] if "REDIS_URL" in env else [f"{component}: no REDIS_URL"])


def port_problems(doc: dict[str, Any], component: str) -> Problems:
    """Declared ports are the ones redbatch listens on; probes use them and real routes."""
    spec = container(doc)
    listening = listening_ports(spec["command"], env_of(spec))
    ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
    problems = [f"{component}: port {n}={p} is not one it listens on {sorted(listening)}"
                for n, p in ports.items() if p not in listening]
    for probe in ("readinessProbe", "livenessProbe"):
        get = spec.get(probe, {}).get("httpGet")
        if get and (ports.get(get["port"], get["port"]) not in listening
                    or get["path"] not in ROUTES[component]):
            problems.append(f"{component}: {probe} {get['path']} on {get['port']}")
    annotated = doc["spec"]["template"]["metadata"].get("annotations", {})
    if int(annotated.get("prometheus.io/port", 0)) not in listening:
        problems.append(f"{component}: prometheus.io/port is not a port it listens on")
    return problems


def selector_problems(doc: dict[str, Any]) -> Problems:
    labels = doc["spec"]["template"]["metadata"]["labels"]
    wanted = doc["spec"]["selector"]["matchLabels"]
    return [] if wanted.items() <= labels.items() else [
        f"{doc['metadata']['name']}: selector {wanted} does not match its pods {labels}"]


def scaledobject_problems(doc: dict[str, Any], worker: dict[str, Any]) -> Problems:
    problems = []
    if (doc.get("apiVersion"), doc.get("kind")) != (KEDA_API, "ScaledObject"):
        problems.append(f"not a {KEDA_API} ScaledObject")
    if doc["spec"]["scaleTargetRef"].get("name") != worker["metadata"]["name"]:
        problems.append("scaleTargetRef does not name the worker Deployment")
    models = served_models(worker)
    for trigger in doc["spec"]["triggers"]:
        meta = trigger.get("metadata", {})
        if trigger.get("type") == PROMETHEUS_TRIGGER:
            problems += prometheus_trigger_problems(meta, models)
        else:
            problems += redis_trigger_problems(trigger.get("type"), meta, models)
    return problems


def redis_trigger_problems(kind: str | None, meta: dict[str, Any], models: set[str]
                           ) -> Problems:
    """A Redis Lists trigger: a served model's queue, a count, Redis as host:port."""
    problems = []
    if kind not in KEDA_TRIGGERS or KEDA_TRIGGERS[kind] not in meta:
        problems.append(f"trigger {kind!r}: no Redis Lists trigger")
    if meta.get("listName") not in {protocol.queue_key(m) for m in models}:
        problems.append(f"listName {meta.get('listName')!r} is no served model's queue")
    if not str(meta.get("listLength", "")).isdigit() or int(meta["listLength"]) < 1:
        problems.append(f"listLength {meta.get('listLength')!r} is not a count")
    if "://" in str(meta.get("address", "")):
        problems.append("address must be host:port, not a URL")
    return problems


def prometheus_trigger_problems(meta: dict[str, Any], models: set[str]) -> Problems:
    """A Prometheus trigger: the largest over the gateways of a fleet-wide gauge of a
    served model, a Prometheus URL and a positive threshold."""
    problems = []
    query = FLEET_QUERY.fullmatch(str(meta.get("query", "")).strip())
    if query is None:
        problems.append(f"query {meta.get('query')!r} is not max(<gauge>{{model=\"...\"}})")
    else:
        if query.group(1) not in FLEET_GAUGES:
            problems.append(f"query: {query.group(1)} is no fleet-wide gauge of the gateway")
        if query.group(2) not in models:
            problems.append(f"query: model {query.group(2)!r} is no served model")
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", str(meta.get("serverAddress", ""))):
        problems.append(f"serverAddress {meta.get('serverAddress')!r} is not an http(s) URL")
    try:
        if float(meta.get("threshold", "")) <= 0:
            problems.append(f"threshold {meta['threshold']!r} is not positive")
    except (TypeError, ValueError):
        problems.append(f"threshold {meta.get('threshold')!r} is not a number")
    return problems


def hpa_problems(doc: dict[str, Any], worker: dict[str, Any]) -> Problems:
    problems = []
    if doc["spec"]["scaleTargetRef"]["name"] != worker["metadata"]["name"]:
        problems.append("scaleTargetRef does not name the worker Deployment")
    for metric in doc["spec"]["metrics"]:
        external = metric.get("external", {})
        if external.get("metric", {}).get("name") != WORKERS_NEEDED_NAME:
            problems.append(f"metric {external.get('metric')} is not {WORKERS_NEEDED_NAME}")
        model = external.get("metric", {}).get("selector", {}).get("matchLabels", {})
        if model.get("model") not in served_models(worker):
            problems.append(f"selector {model} names no served model")
        if external.get("target") != {"type": "AverageValue", "averageValue": "1"}:
            problems.append("target must be AverageValue 1: replicas = workers needed")
    return problems


def adapter_problems(doc: dict[str, Any]) -> Problems:
    rules = yaml.safe_load(doc["data"]["config.yaml"]).get("externalRules", [])
    ours = [r for r in rules if r.get("name", {}).get("as") == WORKERS_NEEDED_NAME]
    if len(ours) != 1:
        return [f"no external rule serves {WORKERS_NEEDED_NAME}"]
    rule = ours[0]
    problems = [] if rule["seriesQuery"].startswith(WORKERS_NEEDED_NAME + "{") else [
        f"seriesQuery {rule['seriesQuery']!r} is not {WORKERS_NEEDED_NAME}"]
    if "by (model)" not in rule["metricsQuery"]:
        problems.append("metricsQuery must keep the model label")
    return problems


# --- the tests --------------------------------------------------------------------------


def test_every_manifest_is_known_and_builtin_kinds_validate() -> None:
    kinds = sorted(doc["kind"] for _name, doc in documents())
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "HorizontalPodAutoscaler",
                     "ScaledObject", "ScaledObject", "ScaledObject", "Service"]
    for name, doc in documents():
        if doc["apiVersion"] != KEDA_API:
            assert schema_problems(doc) == [], name


def test_schema_check_finds_mistakes() -> None:
    worker = copy.deepcopy(deployment("worker"))
    worker["spec"]["replicas"] = "two"
    assert schema_problems(worker)
    worker = copy.deepcopy(deployment("worker"))
    worker["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1  # strict: unknown
    assert schema_problems(worker)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(of_kind("ScaledObject")[0], K8S_VERSION, strict=True)


@pytest.mark.parametrize("component", ["gateway", "worker"])
def test_containers_run_redbatch_as_configured(component: str) -> None:
    doc = deployment(component)
    assert command_problems(doc, component) == []
    assert port_problems(doc, component) == []
    assert selector_problems(doc) == []


def test_container_checks_find_mistakes() -> None:
    gateway = copy.deepcopy(deployment("gateway"))
    spec = gateway["spec"]["template"]["spec"]["containers"][0]
    spec["env"].append({"name": "REDBATCH_NO_SUCH_KNOB", "value": "1"})
    spec["readinessProbe"]["httpGet"]["path"] = "/ready"
    spec["ports"][0]["containerPort"] = 8080
    assert len(command_problems(gateway, "gateway")) == 1
    assert len(port_problems(gateway, "gateway")) == 3  # the port, both probes on it
    assert command_problems(gateway, "worker")


def test_gateway_is_readiness_checked_and_its_service_routes_to_it() -> None:
    gateway = deployment("gateway")
    spec = container(gateway)
    assert spec["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert spec["livenessProbe"]["httpGet"]["path"] == "/healthz"
    (service,) = of_kind("Service")
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {p["name"] for p in spec["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports


def test_workers_request_one_gpu_and_drain_on_stop() -> None:
    worker = deployment("worker")
    resources = container(worker)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    env = env_of(container(worker))
    assert env["REDBATCH_REPLICAS"] == "1"  # one process per pod and GPU
    grace = worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(env["REDBATCH_GRACE_S"])


def test_a_gateway_pod_outlives_its_longest_requests_at_a_stop() -> None:
    """Kubernetes killed it at 30 s (no grace set) while it may answer for 65 s."""
    from redbatch.config import GatewayConfig
    from redbatch.gateway_procs import STOP_MARGIN_S

    gateway = deployment("gateway")
    grace = gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > GatewayConfig().max_timeout_s + STOP_MARGIN_S


def test_scaledobjects_scale_the_workers_on_a_model_queue() -> None:
    worker = deployment("worker")
    objects = of_kind("ScaledObject")
    assert {t["type"] for o in objects for t in o["spec"]["triggers"]} == \
        {*KEDA_TRIGGERS, PROMETHEUS_TRIGGER}
    for doc in objects:
        assert scaledobject_problems(doc, worker) == []
    assert objects[0]["spec"]["triggers"][0]["metadata"]["listName"] == "rb:{mlp}:queue"


def test_scaledobject_check_finds_mistakes() -> None:
    worker = deployment("worker")
    doc = copy.deepcopy(of_kind("ScaledObject")[0])
    doc["apiVersion"] = "keda.k8s.io/v1alpha1"  # KEDA 1
    doc["spec"]["scaleTargetRef"]["name"] = "redbatch-gateway"
    meta = doc["spec"]["triggers"][0]["metadata"]
    meta.update(listName="rb:mlp:queue", listLength="lots", address="redis://redis:6379")
    assert len(scaledobject_problems(doc, worker)) == 5


def prometheus_scaledobject() -> dict[str, Any]:
    [doc] = [o for o in of_kind("ScaledObject")
             if any(t["type"] == PROMETHEUS_TRIGGER for t in o["spec"]["triggers"])]
    return doc


def test_the_prometheus_trigger_scales_on_the_whole_queue() -> None:
    """For a model of several sub-queues: its queue depth over every sub-queue, as the
    gateways export it, the largest over them."""
    doc = prometheus_scaledobject()
    assert scaledobject_problems(doc, deployment("worker")) == []
    [trigger] = doc["spec"]["triggers"]
    assert trigger["metadata"]["query"] == 'max(redbatch_queue_depth{model="mlp"})'


@pytest.mark.parametrize(("field", "value"), [
    ("query", 'sum(redbatch_queue_depth{model="mlp"})'),  # once per gateway
    ("query", 'max(redbatch_queue_lenght{model="mlp"})'),
    ("query", 'max(redbatch_requests_total{model="mlp"})'),  # per gateway, not fleet-wide
    ("query", 'max(redbatch_queue_depth{model="mpl"})'),
    ("serverAddress", "prometheus:9090"),
    ("threshold", "lots"),
    ("threshold", "0"),
])
def test_prometheus_trigger_check_finds_mistakes(field: str, value: str) -> None:
    doc = copy.deepcopy(prometheus_scaledobject())
    doc["spec"]["triggers"][0]["metadata"][field] = value
    assert len(scaledobject_problems(doc, deployment("worker"))) == 1


def test_hpa_and_adapter_rule_use_the_exported_metric() -> None:
    worker = deployment("worker")
    (hpa,) = of_kind("HorizontalPodAutoscaler")
    assert hpa_problems(hpa, worker) == []
    (adapter,) = of_kind("ConfigMap")
    assert adapter_problems(adapter) == []
    hpa = copy.deepcopy(hpa)
    hpa["spec"]["metrics"][0]["external"]["metric"]["name"] = "workers_needed"
    assert len(hpa_problems(hpa, worker)) == 1
    adapter = copy.deepcopy(adapter)
    adapter["data"]["config.yaml"] = adapter["data"]["config.yaml"].replace(
        "redbatch_workers_needed", "redbatch_workers")
    assert adapter_problems(adapter)
