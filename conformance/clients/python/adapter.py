"""The Python client (clients/python) under `idemcheck client`: one ``Client.request`` of a small JSON
body under the operation ``$IDEMCHECK_OPERATION``, the journal in ``$IDEMCHECK_DIR``,
``max_elapsed`` from ``$IDEMCHECK_MAX_ELAPSED``. Exits 0 on a 2xx, 1 on an ``IdempotencyError``.

    idemcheck client -- target/tools/clients-venv/bin/python conformance/clients/python/adapter.py

(the virtual environment that scripts/test-clients makes, with the client installed.)
"""

import os
import sys
from pathlib import Path

from idempotency_client import Client, IdempotencyError


def main() -> int:
    journal = Path(os.environ["IDEMCHECK_DIR"]) / "python-journal.db"
    budget = float(os.environ["IDEMCHECK_MAX_ELAPSED"])
    path = os.environ.get("IDEMCHECK_PATH", "/v1/things")
    with Client(os.environ["IDEMCHECK_URL"], journal=journal, max_elapsed=budget) as client:
        try:
            response = client.request(
                "POST", path, json={"name": "idemcheck"}, operation=os.environ["IDEMCHECK_OPERATION"]
            )
        except IdempotencyError as error:
            print(f"{type(error).__name__}: {error}", file=sys.stderr)
            return 1
    print(response.status_code, response.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
