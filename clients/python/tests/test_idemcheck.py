"""``idemcheck client`` (the workspace's client checker, SPEC 9) against this client through
``conformance/clients/python/adapter.py``: every scenario passes. The binary is ``$IDEMCHECK_BIN``,
else the workspace's debug build; missing, the test is skipped loudly, and fails under ``CI=true``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .leasebroker import REPO

ADAPTER = REPO / "conformance" / "clients" / "python" / "adapter.py"


def idemcheck() -> Path:
    explicit = os.environ.get("IDEMCHECK_BIN")
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    path = Path(explicit) if explicit else target / "debug" / "idemcheck"
    if not path.is_file():
        reason = f"idemcheck binary not found at {path} (build it: cargo build -p idemcheck)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        print(f"SKIPPED: {reason}", file=sys.stderr)
        pytest.skip(reason)
    return path


def test_idemcheck_client_passes_every_scenario() -> None:
    command = [str(idemcheck()), "client", "--budget", "3", "--", sys.executable, str(ADAPTER)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert result.stdout.splitlines()[-1] == "11 passed, 0 failed", output
