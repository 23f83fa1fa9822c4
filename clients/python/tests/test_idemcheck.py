"""``idemcheck client`` (the workspace's client checker, docs/protocol.md#clients) against this client through
``conformance/clients/python/adapter.py``: every scenario passes. The binary is ``$IDEMCHECK_BIN``,
else the workspace's debug build; missing, the test is skipped loudly, and fails under ``CI=true``."""

from __future__ import annotations

import subprocess
import sys

from .leasebroker import REPO, binary

ADAPTER = REPO / "conformance" / "clients" / "python" / "adapter.py"


def test_idemcheck_client_passes_every_scenario() -> None:
    idemcheck = binary("idemcheck", "IDEMCHECK_BIN")
    command = [str(idemcheck), "client", "--budget", "3", "--", sys.executable, str(ADAPTER)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert result.stdout.splitlines()[-1] == "11 passed, 0 failed", output
