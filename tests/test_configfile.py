"""`redbatch up -c FILE`: one TOML file for the gateway and the models."""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from redbatch import configfile
from redbatch.errors import ConfigError
from tests.conftest import ROOT, Proc, free_port, redbatch_cmd, test_env, wait_http

GOOD = """
redis_url = "redis://127.0.0.1:{redis_port}/0"

[gateway]
port = {port}
default_timeout_s = 5
max_queue_len = 500

[worker]
lease_ttl_s = 5
heartbeat_interval_s = 0.5

[[models]]
target = "redbatch.demo:models"
device = "cpu"
replicas = 1
max_batch_size = 4
batch_wait_timeout_s = 0.001
max_batch_cost = 64
max_queue_len = 1000
default_timeout_s = 4
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "redbatch.toml"
    path.write_text(text)
    return path


def test_a_good_file(tmp_path: Path) -> None:
    plan = configfile.load(write(tmp_path, GOOD.format(redis_port=6390, port=8123)))
    assert plan.redis_url == "redis://127.0.0.1:6390/0"
    assert plan.gateway.port == 8123 and plan.gateway.max_queue_len == 500
    (model,) = plan.models
    assert model.target == "redbatch.demo:models" and model.worker.device == "cpu"
    assert model.worker.lease_ttl_s == 5  # [worker] defaults reach every model
    assert model.overrides == {"max_batch_size": 4, "batch_wait_timeout_s": 0.001,
                            "max_batch_cost": 64, "max_queue_len": 1000,
                            "default_timeout_s": 4}


@pytest.mark.parametrize(("text", "message"), [
    ("[gateway]\nprot = 1\n[[models]]\ntarget='a:b'", r"gateway\.prot: unknown field"),
    ("[[models]]\ntarget='a:b'\n[[models]]\ntarget='a:b'\nreplicas='2'",
     r"models\[1\]\.replicas: must be int"),
    ("[[models]]\ntarget='a:b'\nmax_batch_size=0", r"models\[0\]: max_batch_size"),
    ("[[models]]\ntarget='a:b'\nmax_batch_cost=0", r"models\[0\]: max_batch_cost"),
    ("[[models]]\ntarget='a:b'\nauto_batch='yes'", r"models\[0\]\.auto_batch: must be true"),
    ("[[models]]\ntarget='a:b'\nhold_buckets=1", r"models\[0\]\.hold_buckets: must be true"),
    ("[[models]]\ntarget='a:b'\npad_to_longest=1",
     r"models\[0\]\.pad_to_longest: must be true"),
    ("[[models]]\ntarget='a:b'\nmax_batch_size=16.5", r"models\[0\]\.max_batch_size: must"),
    ("[[models]]\ntarget='a:b'\nmax_batch_size=true", r"models\[0\]\.max_batch_size: must"),
    ("[[models]]\ndevice='cpu'", r"models\[0\]\.target: must be MODULE:OBJECT"),
    ("[[models]]\ntarget='a:b'\ndevice='tpu'", r"models\[0\]: device must be"),
    ("[gateway]\nport = 99999\n[[models]]\ntarget='a:b'", r"gateway: port must be"),
    ("[gateway]\nport = true\n[[models]]\ntarget='a:b'", r"gateway\.port: must be int"),
    ("[gateway]\nport = 8000\n", r"models: need at least one"),
    ("[[models]]\ntarget='a:b'\nmax_queue_len=0", r"models\[0\]\.max_queue_len: must"),
    ("[[models]]\ntarget='a:b'\ndefault_timeout_s='5'", r"models\[0\]\.default_timeout_s"),
    ("[gateway\n", r"redbatch\.toml: "),
    ("[[models]]\ntarget='a:b'\npriority_caps=[5, 0]", r"models\[0\]\.priority_caps must"),
    ("[[models]]\ntarget='a:b'\npriority_caps=5", r"models\[0\]\.priority_caps must"),
    ("[[models]]\ntarget='a:b'\npriority_levels=0", r"models\[0\]\.priority_levels: must"),
    ("[[models]]\ntarget='a:b'\ndefault_priority='1'", r"models\[0\]\.default_priority: "),
    ("[[models]]\ntarget='a:b'\npriority_levels=2\ndefault_priority=3",
     r"models\[0\]\.default_priority: .*must be 1\.\.2"),
    ("[[models]]\ntarget='a:b'\ndefault_timeout_s=inf", r"models\[0\]\.default_timeout_s"),
])
def test_a_bad_file_names_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        configfile.load(write(tmp_path, text))


@pytest.mark.parametrize("value", ["123456789", "['Hunter2Key']", "{k = 'Hunter2Key'}"])
def test_a_key_of_the_wrong_type_is_named_without_its_value(tmp_path: Path, value: str) -> None:
    path = write(tmp_path, f"[gateway]\napi_key = {value}\n[[models]]\ntarget='a:b'")
    with pytest.raises(ConfigError, match=r"gateway\.api_key: must be str, got an? ") as err:
        configfile.load(path)
    assert "123456789" not in str(err.value) and "Hunter2Key" not in str(err.value)


def documented_file(redis_port: int | None, port: int) -> str:
    """The example of docs/configuration.md ("One file for everything"), on this
    test's Redis and port."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    example = re.search(r"## One file for everything.*?```toml\n(.*?)```", text, re.S)
    assert example, "docs/configuration.md lost its example file"
    body = re.sub(r'(?m)^redis_url = "[^"]*"', f'redis_url = "redis://127.0.0.1:{redis_port}/0"',
                  example.group(1))
    return re.sub(r"(?m)^port = \d+", f"port = {port}", body)


@pytest.mark.e2e
def test_up_runs_the_documented_file(spawn: Callable[..., Proc], redis_url: str,
                                     tmp_path: Path) -> None:
    port, redis_port = free_port(), urlsplit(redis_url).port
    path = write(tmp_path, documented_file(redis_port, port))
    proc = spawn(redbatch_cmd("up", "-c", str(path)), name="up")
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/readyz", 90, proc)
    assert f"using redis_url of {path}" in proc.log()  # the file's Redis, not an embedded one
    resp = httpx.post(f"{base}/v1/models/adder/predict", json={"inputs": 1}, timeout=30)
    assert resp.json() == {"outputs": 2}
    resp = httpx.post(f"{base}/v1/models/classify_text/predict", json={"text": "a b c"},
                      timeout=30)  # the file's pipeline
    assert resp.status_code == 200 and len(resp.json()["logits"]) == 4, resp.text
    models = {m["name"]: m for m in httpx.get(f"{base}/v1/models", timeout=10).json()["models"]}
    assert models["mlp"]["policy"]["max_batch_size"] == 16  # the file's batching knobs
    assert models["mlp"]["limits"] == {"max_queue_len": 1000, "default_timeout_s": 5}
    assert models["mlp"]["workers"][0]["device"] == "cpu"
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(60) == 0, proc.log()


def test_up_refuses_a_bad_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[[models]]\ntarget='redbatch.demo:models'\nreplicas=0\n")
    done = subprocess.run(redbatch_cmd("up", "-c", str(path)), capture_output=True, text=True,
                          env=test_env(), timeout=60, check=False)
    assert done.returncode == 2 and "models[0]: replicas must be >= 1, got 0" in \
        done.stderr


def test_flags_and_environment_win_over_the_file(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from redbatch import cli

    path = write(tmp_path, GOOD.format(redis_port=6390, port=8123))
    monkeypatch.setenv("REDBATCH_API_KEY", "s3cret")  # secrets live in the environment
    monkeypatch.setenv("REDBATCH_MAX_QUEUE_LEN", "77")
    args = cli.build_parser().parse_args(["up", "-c", str(path), "--replicas", "3"])
    gateway, entries, url = cli._up_plan(args)
    assert gateway.api_key == "s3cret" and gateway.max_queue_len == 77
    assert gateway.port == 8123  # the file, where nothing overrides it
    ((target, worker, overrides),) = entries
    assert target == "redbatch.demo:models"
    assert worker.replicas == 3 and worker.device == "cpu" and worker.lease_ttl_s == 5
    assert url == "redis://127.0.0.1:6390/0" and overrides["max_batch_size"] == 4
    both = cli.build_parser().parse_args(["up", "-c", str(path), "--models", "a:b"])
    with pytest.raises(ConfigError, match="do not mix"):
        cli._up_plan(both)


def test_priority_caps_reach_only_the_models_of_several_levels() -> None:
    from redbatch import Model

    one = Model("one", fn=lambda xs: xs)
    two = Model("two", fn=lambda xs: xs, priority_levels=2)
    got = configfile.with_overrides([one, two], {"priority_caps": [100, 5]})
    assert (got[0].priority_caps, got[1].priority_caps) == (None, [100, 5])
    with pytest.raises(ConfigError, match="2 integers"):
        configfile.with_overrides([two], {"priority_caps": [100]})


def test_the_file_sets_priority_levels() -> None:
    from redbatch import Model

    one = Model("one", fn=lambda xs: xs)
    got = configfile.with_overrides([one], {"priority_levels": 3, "default_priority": 3,
                                            "priority_caps": [100, 50, 5]})[0]
    assert (got.priority_levels, got.default_priority, got.priority_caps) == (3, 3,
                                                                              [100, 50, 5])
    assert got.meta()["priority"] == {"levels": 3, "default": 3, "caps": [100, 50, 5]}
    with pytest.raises(ConfigError, match=r"default_priority must be 1\.\.2"):
        configfile.with_overrides([one], {"priority_levels": 2, "default_priority": 3})


def test_the_files_secrets_are_not_in_its_repr(tmp_path: Path) -> None:
    plan = configfile.load(write(tmp_path, "redis_url = 'redis://:s3cretpw@db.example/0'\n"
                                           "[gateway]\napi_key = 'k3yk3yk3y'\n"
                                           "[[models]]\ntarget = 'redbatch.demo:models'\n"))
    assert plan.redis_url == "redis://:s3cretpw@db.example/0"
    assert "s3cretpw" not in repr(plan) and "k3yk3yk3y" not in repr(plan)


def test_a_file_that_is_not_utf8_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "binary.toml"
    path.write_bytes(b"redis_url = '\xff\xfe'\n")
    with pytest.raises(ConfigError, match=r"binary\.toml: .*utf-8"):
        configfile.load(path)
