"""Every tunable default lives in ``redbatch/defaults.py``: the config dataclasses, the
batching policy and ``@batch`` read it, no other module holds a numeric default of its
own, and ``docs/configuration.md`` shows the same values."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import operator
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from redbatch import defaults
from redbatch.config import ENV_PREFIX, GatewayConfig, RedisSettings, WorkerConfig
from redbatch.worker.model import Model, batch
from redbatch.worker.policy import BatchPolicy

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "redbatch"
DOC = ROOT / "docs" / "configuration.md"

# field -> the defaults.py name it reads, for every field that has a default
REDIS = {"url": "REDIS_URL", "socket_timeout_s": "SOCKET_TIMEOUT_S",
         "connect_timeout_s": "CONNECT_TIMEOUT_S"}
GATEWAY = {"host": "HOST", "port": "PORT", "default_timeout_s": "DEFAULT_TIMEOUT_S",
           "max_timeout_s": "GATEWAY_MAX_TIMEOUT_S", "max_body_bytes": "MAX_BODY_BYTES",
           "max_queue_len": "MAX_QUEUE_LEN", "max_waiters": "MAX_WAITERS",
           "meta_refresh_s": "META_REFRESH_S", "block_timeout_s": "BLOCK_TIMEOUT_S",
           "api_key": "API_KEY", "max_header_bytes": "MAX_HEADER_BYTES",
           "header_timeout_s": "HEADER_TIMEOUT_S", "body_timeout_s": "BODY_TIMEOUT_S",
           "send_timeout_s": "SEND_TIMEOUT_S",
           "keep_alive_s": "KEEP_ALIVE_S",
           "max_connections": "GATEWAY_MAX_CONNECTIONS",
           "gateway_processes": "GATEWAY_PROCESSES", "wait_replicas": "WAIT_REPLICAS",
           "wait_timeout_ms": "WAIT_TIMEOUT_MS"}
WORKER = {"block_timeout_s": "BLOCK_TIMEOUT_S", "heartbeat_interval_s": "HEARTBEAT_INTERVAL_S",
          "lease_ttl_s": "LEASE_TTL_S", "replicas": "REPLICAS", "device": "DEVICE",
          "threads": "THREADS", "max_attempts": "MAX_ATTEMPTS", "grace_s": "GRACE_S",
          "metrics_port": "METRICS_PORT", "dead_letter_ttl_s": "DEAD_LETTER_TTL_S",
          "dead_letter_max_bytes": "DEAD_LETTER_MAX_BYTES",
          "max_failed_starts": "MAX_FAILED_STARTS"}
POLICY = {"max_batch_size": "MAX_BATCH_SIZE", "batch_wait_timeout_s": "BATCH_WAIT_TIMEOUT_S",
          "stride_s": "STRIDE_S", "allow_small_batch": "ALLOW_SMALL_BATCH",
          "adaptive": "ADAPTIVE", "quiet_s": "QUIET_S", "max_batch_cost": "MAX_BATCH_COST",
          "max_concurrent_batches": "MAX_CONCURRENT_BATCHES", "auto_batch": "AUTO_BATCH",
          "hold_buckets": "HOLD_BUCKETS", "pad_to_longest": "PAD_TO_LONGEST"}
MODEL = {"input_name": "INPUT_NAME", "output_name": "OUTPUT_NAME", "oversize": "OVERSIZE",
         "priority_levels": "PRIORITY_LEVELS", "default_priority": "DEFAULT_PRIORITY",
         "priority_share": "PRIORITY_SHARE"}
BATCH = {**{k: v for k, v in POLICY.items() if k not in {"adaptive", "quiet_s"}},
         **MODEL}

# Parameters allowed a numeric literal default, each with its reason.
EXEMPT = {
    ("redbatch/bench/producer.py", "wait_live_workers", "timeout_s"):
        "benchmark harness: how long it waits for servers it started itself",
    ("redbatch/bench/servers.py", "wait_ok", "timeout_s"): "benchmark harness, as above",
    ("redbatch/bench/servers.py", "start_ray", "timeout_s"): "benchmark harness, as above",
}
ALLOWED = {(int, 0), (int, 1), (int, -1), (float, 0.0)}
OPERATORS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow,
    ast.LShift: operator.lshift}


def _field_defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING}


def _same(value: Any, expected: Any) -> bool:
    return type(value) is type(expected) and value == expected


@pytest.mark.parametrize(("cls", "names"), [
    (RedisSettings, REDIS), (GatewayConfig, GATEWAY), (WorkerConfig, WORKER),
    (BatchPolicy, POLICY)])
def test_config_dataclasses_read_defaults_py(cls: type, names: dict[str, str]) -> None:
    found = _field_defaults(cls)
    assert set(found) == set(names), "map every field with a default to its defaults.py name"
    for field, name in names.items():
        assert _same(found[field], getattr(defaults, name)), (cls.__name__, field, name)


def test_instances_carry_the_defaults() -> None:
    """What a caller gets: the instances, not only the declarations."""
    for cls, names in ((RedisSettings, REDIS), (GatewayConfig, GATEWAY),
                       (WorkerConfig, WORKER), (BatchPolicy, POLICY)):
        instance = cls()
        for field, name in names.items():
            assert _same(getattr(instance, field), getattr(defaults, name)), (cls, field)


def test_batch_decorator_and_model_read_defaults_py() -> None:
    params = inspect.signature(batch).parameters
    for param, name in BATCH.items():
        assert _same(params[param].default, getattr(defaults, name)), param
    model = batch(name="m")(lambda items: items)
    assert model.policy == BatchPolicy()
    for field, name in MODEL.items():
        assert _same(_field_defaults(Model)[field], getattr(defaults, name)), field
        assert getattr(model, field) == getattr(defaults, name)


CLIENT = {"default_timeout_s": "DEFAULT_TIMEOUT_S", "max_timeout_s": "CLIENT_MAX_TIMEOUT_S",
          "max_queue_len": "MAX_QUEUE_LEN", "max_waiters": "MAX_WAITERS",
          "block_timeout_s": "BLOCK_TIMEOUT_S", "pack_rows": "PACK_ROWS"}


def test_client_reads_defaults_py() -> None:
    from redbatch.producer.client import Client

    params = inspect.signature(Client).parameters
    for param, name in CLIENT.items():
        assert _same(params[param].default, getattr(defaults, name)), param
    client = Client("redis://127.0.0.1:1/0")
    assert (client.default_timeout_s, client.pack_rows) == (defaults.DEFAULT_TIMEOUT_S,
                                                           defaults.PACK_ROWS)


def test_distinct_defaults_keep_their_values() -> None:
    """Two settings of one name whose defaults differ have a name each."""
    from redbatch import protocol

    assert defaults.GATEWAY_MAX_TIMEOUT_S == 60.0
    assert _same(defaults.CLIENT_MAX_TIMEOUT_S, protocol.MAX_TIMEOUT_S)  # the wire's limit
    assert (defaults.GATEWAY_MAX_CONNECTIONS, defaults.REDIS_MAX_CONNECTIONS) == (1024, 32)


# --- no numeric default outside defaults.py --------------------------------------------
def _number(node: ast.expr) -> int | float | None:
    """The value of an expression made of numeric literals only (``64 * 1024``, ``-1``),
    else None (names, calls, strings, bools)."""
    if isinstance(node, ast.Constant):
        value = node.value
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        operand = _number(node.operand)
        return None if operand is None else -operand
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _number(node.left), _number(node.right)
        if left is None or right is None:
            return None
        result: int | float = OPERATORS[type(node.op)](left, right)
        return result
    return None


def _param_defaults(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
                    ) -> list[tuple[str, ast.expr]]:
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults,
                     strict=True))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
              if d is not None]
    return [(a.arg, d) for a, d in pairs]


def _is_dataclass(node: ast.ClassDef) -> bool:
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if ast.unparse(target) in {"dataclass", "dataclasses.dataclass"}:
            return True
    return False


def _field_default(stmt: ast.stmt) -> tuple[str, ast.expr] | None:
    if not isinstance(stmt, ast.AnnAssign) or stmt.value is None:
        return None
    value: ast.expr | None = stmt.value
    if isinstance(value, ast.Call) and ast.unparse(value.func) in {"field", "dataclasses.field"}:
        value = next((k.value for k in value.keywords if k.arg == "default"), None)
    return None if value is None else (ast.unparse(stmt.target), value)


def numeric_defaults(source: str) -> list[tuple[str, str, int | float]]:
    """(owner, name, value) of each numeric literal default of a function parameter or a
    dataclass field in ``source``, other than 0, 1, -1 and 0.0."""
    found: list[tuple[str, str, int | float]] = []
    for node in ast.walk(ast.parse(source)):
        pairs: list[tuple[str, ast.expr]] = []
        owner = getattr(node, "name", "<lambda>")
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            pairs = _param_defaults(node)
        elif isinstance(node, ast.ClassDef) and _is_dataclass(node):
            pairs = [p for s in node.body if (p := _field_default(s)) is not None]
        for name, expr in pairs:
            value = _number(expr)
            if value is not None and (type(value), value) not in ALLOWED:
                found.append((owner, name, value))
    return found


def test_the_check_finds_literal_defaults() -> None:
    source = '''
from dataclasses import dataclass, field
def f(a, b=0, c=-1, d=0.0, e=1, g=2.5, *, h=64 * 1024, i=None, j="x", k=True, m=-3): ...
async def n(p=1.0): ...
@dataclass
class C:
    q: int = 5
    r: int = field(default=7, repr=False)
    s: int = 0
    t: str = "8"
class Plain:
    u: int = 9  # a class constant, not a dataclass field
lam = lambda v=3: v
'''
    assert numeric_defaults(source) == [
        ("f", "g", 2.5), ("f", "h", 65536), ("f", "m", -3), ("n", "p", 1.0),
        ("C", "q", 5), ("C", "r", 7), ("<lambda>", "v", 3)]


def test_no_numeric_default_outside_defaults_py() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "redbatch/defaults.py":
            continue
        for owner, name, value in numeric_defaults(path.read_text()):
            if (rel, owner, name) not in EXEMPT:
                offenders.append(f"{rel}: {owner}({name}={value!r})")
    assert not offenders, "move these defaults to redbatch/defaults.py: " + "; ".join(offenders)


def test_exemptions_are_still_needed() -> None:
    """An exemption whose default went away is deleted, not kept."""
    for rel, owner, name in EXEMPT:
        found = numeric_defaults((ROOT / rel).read_text())
        assert any((o, n) == (owner, name) for o, n, _ in found), (rel, owner, name)


def test_every_default_is_a_final_with_a_comment() -> None:
    source = (PACKAGE / "defaults.py").read_text()
    lines = source.splitlines()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            pytest.fail(f"defaults.py line {node.lineno}: annotate it Final")
        if isinstance(node, ast.AnnAssign):
            assert "Final" in ast.unparse(node.annotation), node.lineno
            assert "  # " in lines[node.lineno - 1], f"line {node.lineno}: say what it is"


# --- docs/configuration.md -------------------------------------------------------------
# env var -> defaults.py name where it is not the variable less its prefix
NAME = re.compile(r"[A-Z][A-Z0-9_]*")
DOC_NAMES = {"REDIS_URL": "REDIS_URL", "REDBATCH_MAX_TIMEOUT_S": "GATEWAY_MAX_TIMEOUT_S",
             "REDBATCH_MAX_CONNECTIONS": "GATEWAY_MAX_CONNECTIONS"}


def _rows() -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in DOC.read_text().splitlines()
            if line.startswith("| ") and not line.startswith("|---")]


def _documented(cell: str, value: Any) -> bool:
    """Whether a table cell shows ``value``: a number first, or the string (in backticks
    or first), or "unset" for an empty string."""
    if isinstance(value, bool):
        return cell.split(maxsplit=1)[0].lower() == str(value).lower()
    if isinstance(value, int | float):
        return float(cell.split(maxsplit=1)[0].replace("_", "")) == value
    if value is None:
        return cell.startswith("none")
    if value == "":
        return cell.startswith("unset")
    return f"`{value}`" in cell or cell.split(maxsplit=1)[0] == value


def _env_table() -> dict[str, str]:
    """env var -> its default cell, from the table of environment variables."""
    return {r[0].strip("`"): r[2] for r in _rows()
            if len(r) == 4 and re.fullmatch(r"`(REDBATCH_[A-Z0-9_]+|REDIS_URL)`", r[0])}


def _names_table() -> dict[str, str]:
    """defaults.py name -> its default cell, from the table that names them."""
    return {r[3].strip("`"): r[2] for r in _rows()
            if len(r) == 4 and re.fullmatch(r"`[A-Z][A-Z0-9_]*`", r[3])}


def test_doc_env_table_matches_defaults_py() -> None:
    table = _env_table()
    settings = {ENV_PREFIX + f.name.upper() for cls in (RedisSettings, GatewayConfig,
                                                        WorkerConfig)
                for f in dataclasses.fields(cls) if f.name != "url"}
    assert settings <= set(table), f"undocumented: {sorted(settings - set(table))}"
    checked = 0
    for env, cell in table.items():
        name = DOC_NAMES.get(env, env.removeprefix(ENV_PREFIX))
        if hasattr(defaults, name):
            assert _documented(cell, getattr(defaults, name)), (env, cell)
            checked += 1
    assert checked >= len(settings)


def test_doc_names_table_matches_defaults_py() -> None:
    table = _names_table()
    assert len(table) >= 10
    for name, cell in table.items():
        assert _documented(cell, getattr(defaults, name)), (name, cell)


def test_every_default_is_documented() -> None:
    env_names = {DOC_NAMES.get(env, env.removeprefix(ENV_PREFIX)) for env in _env_table()}
    names = {n for n in vars(defaults) if NAME.fullmatch(n)}
    missing = names - env_names - set(_names_table())
    assert not missing, f"document these in docs/configuration.md: {sorted(missing)}"


def test_doc_check_spots_a_wrong_value() -> None:
    assert _documented("30", 30.0) and not _documented("31", 30.0)
    assert _documented("`auto`, `cpu`", "auto") and not _documented("cpu", "auto")
    assert _documented("unset (no auth)", "") and not _documented("x", "")
    assert _documented("true", True) and not _documented("false", True)


# --- the command line's help ---------------------------------------------------------------
def _help_default(text: str) -> str | None:
    """The default a flag's help states: the start of its last parenthesis, e.g. "8000"
    of "port (8000; $REDBATCH_PORT)", "1 MiB" of "request body limit (1 MiB)"."""
    found = re.findall(r"\(([^()]*)\)", text)
    return re.split(r"[;:]", found[-1])[0].strip() if found else None


def _help_value(stated: str) -> float | str:
    number = re.fullmatch(r"(\d+(?:\.\d+)?)( MiB)?", stated)
    if number is None:
        return stated
    return float(number[1]) * (1024 * 1024 if number[2] else 1)


def test_flag_help_states_the_defaults_py_value() -> None:
    """The flags of `up`, `gateway` and `worker` say their default in their help; it
    must be the one the settings get."""
    from redbatch.cli import build_parser

    names = {**REDIS, **GATEWAY, **WORKER, "log_level": "LOG_LEVEL",
             "interval_s": "STATUS_INTERVAL_S"}
    group = build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    commands = cast(dict[str, argparse.ArgumentParser], group.choices)
    checked = 0
    for command in ("up", "gateway", "worker", "status"):
        for action in commands[command]._actions:
            stated = _help_default(action.help or "")
            if action.dest not in names or stated is None:
                continue
            want = getattr(defaults, names[action.dest])
            got = _help_value(stated)
            assert got == want, f"{command} --{action.dest}: help says {stated!r}, not {want!r}"
            checked += 1
    assert checked >= 20


def test_help_parsing() -> None:
    assert _help_default("port (8000; $REDBATCH_PORT)") == "8000"
    assert _help_value("1 MiB") == 1024 * 1024
    assert _help_default("Prometheus (0: off; $X)") == "0"
    assert _help_value("auto") == "auto"
    assert _help_default("no default") is None
