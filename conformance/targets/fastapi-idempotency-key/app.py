"""A FastAPI app behind fastapi-idempotency-key 0.1.1, wired as its README's quick start shows:
``app.add_middleware(IdempotencyMiddleware, backend=MemoryBackend(), header_name="Idempotency-Key",
default_ttl=86400)``, the other options at their defaults (key optional, 409 in flight, 422 for
a reused key, ``Idempotency-Replayed`` on replays).

The middleware keys its records by the key alone: it has no notion of a principal, so the two
bearer tokens are authenticated here (outside the middleware, so a 401 never reaches it) but
cannot scope the records.

Routes: POST /v1/widgets and POST /v1/gadgets create (201, Location, JSON with an id) after
``delay_ms`` of the body (default 300); {"fail": "server"} answers 500 and {"invalid": true} 422.
GET /counter answers {"executions": N}, the creates run so far. FIXTURE_TOKENS=tok=name,...;
PORT (default 0: any free port); the first line printed is ``listening on http://...``.
"""

import asyncio
import json
import os
import socket
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi_idempotency_key import IdempotencyMiddleware, MemoryBackend

TOKENS = dict(
    pair.split("=", 1) for pair in os.environ.get("FIXTURE_TOKENS", "").split(",") if "=" in pair
)
STATE = {"executions": 0}


class Auth:
    """Bearer tokens; a request without a known one is answered 401 before the middleware."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        who = TOKENS.get(auth[len("Bearer ") :]) if auth.startswith("Bearer ") else None
        if who is None:
            return await JSONResponse({"error": "unauthorized"}, 401)(scope, receive, send)
        scope.setdefault("state", {})["principal"] = who
        return await self.app(scope, receive, send)


def creator(kind):
    async def create(request: Request):
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            return JSONResponse({"error": "the body is not JSON"}, 400)
        if not isinstance(body, dict):
            body = {}
        if body.get("fail") == "server":
            return JSONResponse({"error": "the backend failed"}, 500)
        if body.get("invalid") is True:
            return JSONResponse({"error": "invalid fields"}, 422)
        delay = body.get("delay_ms")
        delay = delay if isinstance(delay, int) and not isinstance(delay, bool) else 300
        await asyncio.sleep(max(0, min(delay, 10_000)) / 1000)
        STATE["executions"] += 1
        ident = f"{kind}-{STATE['executions']}"
        made = {"id": ident, "kind": kind, "owner": request.state.principal, "name": body.get("name")}
        return JSONResponse(made, 201, headers={"Location": f"/v1/{kind}s/{ident}"})

    return create


app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware,
    backend=MemoryBackend(),
    header_name="Idempotency-Key",
    default_ttl=86400,
)
# Added last, so outermost: authentication runs before the idempotency middleware.
app.add_middleware(Auth)
app.post("/v1/widgets")(creator("widget"))
app.post("/v1/gadgets")(creator("gadget"))


@app.get("/counter")
async def counter():
    return JSONResponse({"executions": STATE["executions"]})


def main():
    if not TOKENS:
        print("fastapi-idempotency-key fixture: set FIXTURE_TOKENS=token=principal,...", file=sys.stderr)
        sys.exit(2)
    sock = socket.socket()
    sock.bind(("127.0.0.1", int(os.environ.get("PORT", "0"))))
    print(f"listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(app, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
