"""scripts/chaos end to end: the ledger must show nothing lost and nothing duplicated."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, test_env

pytestmark = [pytest.mark.e2e, pytest.mark.serial]


@pytest.mark.timeout(240)
def test_chaos_ledger_is_clean() -> None:
    result = subprocess.run([sys.executable, "scripts/chaos.py", "--duration-s", "9",
                             "--concurrency", "16"], cwd=ROOT, env=test_env(),
                            capture_output=True, text=True, timeout=200, check=False)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert re.search(r"^\s+lost\s+0$", out, re.M), out
    assert re.search(r"^\s+duplicated\s+0$", out, re.M), out
    accepted = int(re.search(r"^\s+accepted\s+(\d+)$", out, re.M).group(1))  # type: ignore[union-attr]
    assert accepted > 100, out
    assert "kill -9 replica" in out and "restarted redis-server" in out


@pytest.mark.timeout(240)
def test_chaos_redis_stall_answers_every_request_by_its_deadline() -> None:
    result = subprocess.run([sys.executable, "scripts/chaos.py", "--scenario", "stall",
                             "--stall-s", "3", "--duration-s", "9", "--rate", "30"],
                            cwd=ROOT, env=test_env(), capture_output=True, text=True,
                            timeout=200, check=False)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert re.search(r"no answer by deadline\+0.5s\s+0$", out, re.M), out
