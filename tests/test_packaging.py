"""Packaging and layering: what ``import redbatch`` costs, who may import the worker,
and what a plain ``pip install redbatch`` gives."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, test_env

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


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], check=False, env=test_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


# What a producer must not pay for: torch, the web server, the worker, its metrics.
HEAVY = ("heavy = [m for m in ('torch', 'starlette', 'uvicorn', 'prometheus_client', "
         "'redbatch.worker') if m in sys.modules]")


@pytest.mark.parametrize("statement", [
    "import redbatch",
    "from redbatch import Client, SyncClient, TensorSpec, RedbatchError, Request",
    "import redbatch.spec, redbatch.registry, redbatch.producer",
])
def test_the_producer_side_imports_neither_torch_nor_a_web_server(statement: str) -> None:
    done = _fresh_python(f"import sys\n{statement}\n{HEAVY}\nassert not heavy, heavy")
    assert done.returncode == 0, done.stderr


def test_import_redbatch_alone_imports_no_third_party_module() -> None:
    code = ("import sys\nimport redbatch\n"
            "extra = {m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)\n"
            "extra = {m for m in extra if not m.startswith('_') and m != 'redbatch'}\n"
            "assert not extra - {'cython_runtime'}, extra\n")
    done = _fresh_python(code)
    assert done.returncode == 0, done.stderr


def test_worker_names_still_import_from_the_package() -> None:
    code = ("import redbatch\n"
            "from redbatch import Model, Pool, Worker, batch, torch_model, BatchPolicy\n"
            "assert set(redbatch.__all__) <= set(dir(redbatch))\n"
            "assert all(getattr(redbatch, n) is not None for n in redbatch.__all__)\n")
    done = _fresh_python(code)
    assert done.returncode == 0, done.stderr


def test_an_unknown_attribute_is_an_attribute_error() -> None:
    import redbatch

    with pytest.raises(AttributeError, match="no_such_name"):
        _ = redbatch.no_such_name  # type: ignore[attr-defined]
