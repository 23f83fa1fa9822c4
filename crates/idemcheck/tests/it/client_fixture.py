"""A client for `idemcheck client`'s own tests (Python standard library only), right by default and
wrong in one way per mode, so that each scenario is shown able to fail:

    python3 client_fixture.py MODE

MODE: good | fresh-key (a new key per attempt) | ignore-retry-after | retry-refusals (retries a
mismatch and any 4xx) | no-journal (the key lives in the process only) | no-budget (retries
forever) | one-key (the same key for every operation).

It makes one POST to $IDEMCHECK_URL$IDEMCHECK_PATH under $IDEMCHECK_OPERATION, retrying lost
answers, 5xx, 429 and 409 request-in-progress with backoff and Retry-After, within
$IDEMCHECK_MAX_ELAPSED seconds; the key of an operation is kept in a file under $IDEMCHECK_DIR,
written before the first attempt. Exits 0 on a 2xx, 1 otherwise.
"""

import json
import os
import random
import sys
import time
import urllib.error
import urllib.request
import uuid

MODES = ("good", "fresh-key", "ignore-retry-after", "retry-refusals", "no-journal", "no-budget", "one-key")
# No proxy from the environment: the scripted API is on loopback.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def journaled_key(operation, directory):
    """The operation's key from the journal file, or a new one written there first."""
    path = os.path.join(directory, f"fixture-{operation}.key")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        pass
    key = str(uuid.uuid4())
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(key)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return key


def first_key(mode, operation, directory):
    if mode == "one-key":
        return "idemcheck-fixture-one-key"
    if mode in ("fresh-key", "no-journal"):
        return str(uuid.uuid4())
    return journaled_key(operation, directory)


def send(url, key, body):
    """(status, headers, body); status None when no answer came."""
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json", "Idempotency-Key": key}
    )
    try:
        with OPENER.open(request, timeout=30) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()
    except OSError:  # refused, reset, closed without an answer, timed out
        return None, None, b""


def problem_name(body):
    try:
        return str(json.loads(body).get("type", "")).rsplit("/", 1)[-1]
    except (ValueError, AttributeError):
        return ""


def retryable(mode, status, body):
    if status is None or status >= 500 or status == 429:
        return True
    if status == 409 and problem_name(body) == "request-in-progress":
        return True
    return mode == "retry-refusals"


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "good"
    if mode not in MODES:
        print(f"client_fixture.py: unknown mode {mode}; one of {', '.join(MODES)}", file=sys.stderr)
        return 2
    url = os.environ["IDEMCHECK_URL"] + os.environ.get("IDEMCHECK_PATH", "/v1/things")
    budget = float(os.environ["IDEMCHECK_MAX_ELAPSED"])
    key = first_key(mode, os.environ["IDEMCHECK_OPERATION"], os.environ["IDEMCHECK_DIR"])
    body = json.dumps({"name": "idemcheck-fixture"}).encode()
    start, cap, attempt = time.monotonic(), 0.1, 0
    while True:
        if mode == "fresh-key" and attempt > 0:
            key = str(uuid.uuid4())
        attempt += 1
        status, headers, answer = send(url, key, body)
        print(f"attempt {attempt}: {status}", file=sys.stderr, flush=True)
        if status is not None and 200 <= status < 300:
            print(answer.decode(errors="replace"))
            return 0
        if not retryable(mode, status, answer):
            print(f"refused: {status} {answer.decode(errors='replace')}", file=sys.stderr)
            return 1
        wait = random.uniform(0, cap)
        cap = min(cap * 2, 1.0)
        asked = headers.get("Retry-After") if headers is not None else None
        if asked and mode != "ignore-retry-after":
            wait = max(wait, float(asked))
        if mode != "no-budget" and time.monotonic() - start + wait >= budget:
            print(f"gave up after {attempt} attempts: {status}", file=sys.stderr)
            return 1
        time.sleep(wait)


if __name__ == "__main__":
    sys.exit(main())
