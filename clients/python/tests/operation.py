"""One logical create through the client, as a separate process: the tests kill it, rerun it, and
run several at once on one journal.

    python operation.py URL TOKEN JOURNAL OPERATION BODY_JSON [MAX_ELAPSED [PATH [HEADERS_JSON]]]

PATH is where the create goes (``/v1/workers``, leasebroker's, unless given); HEADERS_JSON, an
object of headers sent with it besides the bearer token.

Prints one JSON line: the status, the body, whether the answer came from the journal, or the error.
"""

from __future__ import annotations

import json
import sys

from idempotency_client import Client, IdempotencyError


def main() -> int:
    url, token, journal, operation, body = sys.argv[1:6]
    max_elapsed = float(sys.argv[6]) if len(sys.argv) > 6 else 120.0
    path = sys.argv[7] if len(sys.argv) > 7 else "/v1/workers"
    extra: dict[str, str] = json.loads(sys.argv[8]) if len(sys.argv) > 8 else {}
    headers = {"Authorization": f"Bearer {token}", **extra}
    with Client(url, headers=headers, journal=journal, max_elapsed=max_elapsed) as client:
        try:
            response = client.request("POST", path, json=json.loads(body), operation=operation)
        except IdempotencyError as error:
            print(json.dumps({"error": type(error).__name__, "message": str(error)}), flush=True)
            return 1
    journaled = "idempotency-client-journal" in response.headers
    print(json.dumps({"status": response.status_code, "body": response.json(), "journal": journaled}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
