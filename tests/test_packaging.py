"""Packaging and layering: what ``import redbatch`` costs, who may import the worker,
and what a plain ``pip install redbatch`` gives."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from redbatch.bench.mlp import build_mlp
from redbatch.registry import live_workers_sync
from tests.conftest import ROOT, Proc, redbatch_cmd, test_env

PACKAGE = ROOT / "redbatch"


def _worker_imports(path: Path) -> list[str]:
    """The ``redbatch.worker`` imports in one module (absolute or relative)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = _from_targets(node, path)
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names
                  if name == "redbatch.worker" or name.startswith("redbatch.worker.")]
    return found


def _from_targets(node: ast.ImportFrom, path: Path) -> list[str]:
    """What ``from X import a, b`` names: X, and X.a, X.b (for ``from redbatch import
    worker``); a relative X is resolved against the module's package."""
    base = node.module or ""
    if node.level:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)[:-node.level]
        base = ".".join([*parts, base] if base else parts)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


@pytest.mark.parametrize("layer", ["api", "producer"])
def test_layer_does_not_import_the_worker(layer: str) -> None:
    offending = [hit for path in sorted((PACKAGE / layer).rglob("*.py"))
                 for hit in _worker_imports(path)]
    assert offending == []


def test_the_layer_check_sees_worker_imports(tmp_path: Path) -> None:
    """The scan above catches every spelling (else it could pass vacuously)."""
    module = PACKAGE / "api" / "_probe_for_test.py"
    sources = ["from redbatch.worker.heartbeat import beat", "import redbatch.worker.model",
               "from redbatch import worker", "from ..worker import model"]
    for source in sources:
        module.write_text(source + "\n")
        try:
            assert len(_worker_imports(module)) >= 1, source
        finally:
            module.unlink()


def _fresh_python(code: str) -> None:
    """Run ``code`` in a new interpreter; it must succeed (its asserts hold)."""
    done = subprocess.run([sys.executable, "-c", code], check=False, env=test_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# What a producer must not pay for: torch, the web server, the worker, its metrics.
HEAVY = ("heavy = [m for m in ('torch', 'starlette', 'uvicorn', 'prometheus_client', "
         "'redbatch.worker') if m in sys.modules]")


@pytest.mark.parametrize("statement", [
    "import redbatch",
    "from redbatch import Client, SyncClient, TensorSpec, RedbatchError, Request",
    "import redbatch.spec, redbatch.registry, redbatch.producer",
])
def test_the_producer_side_imports_neither_torch_nor_a_web_server(statement: str) -> None:
    _fresh_python(f"import sys\n{statement}\n{HEAVY}\nassert not heavy, heavy")


def test_import_redbatch_alone_imports_no_third_party_module() -> None:
    code = ("import sys\nimport redbatch\n"
            "extra = {m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)\n"
            "extra = {m for m in extra if not m.startswith('_') and m != 'redbatch'}\n"
            "assert not extra - {'cython_runtime'}, extra\n")
    _fresh_python(code)


def test_worker_names_still_import_from_the_package() -> None:
    code = ("import redbatch\n"
            "from redbatch import Model, Pool, Worker, batch, torch_model, BatchPolicy\n"
            "assert set(redbatch.__all__) <= set(dir(redbatch))\n"
            "assert all(getattr(redbatch, n) is not None for n in redbatch.__all__)\n")
    _fresh_python(code)


def test_an_unknown_attribute_is_an_attribute_error() -> None:
    import redbatch

    with pytest.raises(AttributeError, match="no_such_name"):
        _ = redbatch.no_such_name  # type: ignore[attr-defined]


def test_the_version_comes_from_the_package_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    import redbatch
    from redbatch import cli

    assert redbatch.__version__ == metadata.version("redbatch")
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out.strip() == f"redbatch {metadata.version('redbatch')}"


def test_the_version_of_an_uninstalled_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    import redbatch

    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert redbatch._version() == "0.0.0+unknown"


# --- the built wheel, installed alone -----------------------------------------------

BASELINES = ("naive.py", "ray_app.py")
CLIENT = """
import json, sys
import numpy as np
from redbatch import SyncClient
with SyncClient(sys.argv[1]) as client:
    y = client.predict("mlp", [i / 64 for i in range(64)], timeout_s=30)
print(json.dumps(np.asarray(y).tolist()))
"""


def _run(args: list[str], timeout_s: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=False, capture_output=True, text=True, timeout=timeout_s,
                          **kwargs)


def _build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of the source tree (the build leaves the checkout alone)."""
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src / "redbatch",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    done = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "-q", "-w", str(tmp_path / "dist"), str(src)], 120)
    assert done.returncode == 0, done.stderr
    return next((tmp_path / "dist").glob("redbatch-*.whl"))


def _core_venv(tmp_path: Path, wheel: Path) -> Path:
    """A fresh virtualenv with the wheel alone (its core dependencies from the index)."""
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)], 60).returncode == 0
    done = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                 "--disable-pip-version-check", str(wheel)], 240)
    assert done.returncode == 0, done.stderr
    return venv / "bin"


def _wait_for_workers(redis_url: str, model: str, timeout_s: float = 60) -> None:
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while not live_workers_sync(client, model):
            assert time.monotonic() < deadline, f"no live worker of {model!r}"
            time.sleep(0.1)
    finally:
        client.close()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_core_wheel_installs_without_torch_and_feeds_a_worker(
        tmp_path: Path, redis_url: str, spawn: Callable[..., Proc]) -> None:
    worker = spawn(redbatch_cmd("worker", "redbatch.demo:models", "--redis-url", redis_url,
                                "--device", "cpu", "--threads", "1"), name="worker")
    wheel = _build_wheel(tmp_path)
    files = zipfile.ZipFile(wheel).namelist()
    assert "redbatch/spec.py" in files and "redbatch/bench/wrk/w2.lua" in files
    assert [f for f in files if f.rsplit("/", 1)[-1] in BASELINES] == []
    bin_dir = _core_venv(tmp_path, wheel)
    plain = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REDIS_URL")}
    python = [str(bin_dir / "python"), "-c"]
    assert _run([*python, "import torch"], 60, env=plain, cwd=tmp_path).returncode != 0
    version = _run([str(bin_dir / "redbatch"), "--version"], 60, env=plain, cwd=tmp_path)
    assert version.stdout.strip() == f"redbatch {metadata.version('redbatch')}", version
    _wait_for_workers(redis_url, "mlp")
    done = _run([*python, CLIENT, redis_url], 90, env=plain, cwd=tmp_path)
    assert done.returncode == 0, f"{done.stderr}\n{worker.log()}"
    with torch.inference_mode():
        want = build_mlp()(torch.tensor([[i / 64 for i in range(64)]])).numpy()[0]
    np.testing.assert_allclose(json.loads(done.stdout), want, atol=1e-5)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_command_without_its_extra_names_the_extra(tmp_path: Path, redis_url: str) -> None:
    bin_dir = _core_venv(tmp_path, _build_wheel(tmp_path))
    plain = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REDIS_URL")}
    done = _run([str(bin_dir / "redbatch"), "gateway", "--redis-url", redis_url], 60,
                env=plain, cwd=tmp_path)
    assert done.returncode == 2
    assert "pip install 'redbatch[gateway]'" in done.stderr
    assert "Traceback" not in done.stderr
