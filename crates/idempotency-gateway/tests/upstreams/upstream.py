#!/usr/bin/env python3
"""A small upstream service for the gateway's tests (Python, standard library only).

It counts its own side effects, so a test asks the service itself how often a request ran
instead of trusting the gateway. Every POST, PUT, PATCH or DELETE is an "execution"; knobs in
request headers (not part of a request's fingerprint, so a retry without them is the same
request) change how it answers:

  X-Upstream-Delay-Ms: N   wait N ms after counting, before answering
  X-Upstream-Status: N     answer with status N
  X-Upstream-Reset: 1      count, then reset the connection instead of answering
  X-Upstream-Size: N       answer with a body of N bytes
  X-Upstream-Skip: 1       do nothing (not counted) and answer X-Upstream-Status (a 5xx that did not act)
  X-Upstream-Stall: 1      count, send the status line and part of the body, then never finish

With --dedupe the service deduplicates by the Idempotency-Key it receives (as an upstream that
honours the gateway's forwarded key would): a known key is answered from memory, not counted.

  GET /__count                 {"executions": N, "by_key": {KEY: N}, "by_op": {OP: [N, ...]}, "last": {headers}}

A request whose body is a JSON object with a string "op" (one logical operation of a client, as
faultline's gateway mode sends) is also counted under that operation in "by_op": the order
numbers of its executions, so a caller can tell an operation run twice whatever key it carried.
  GET /orders/by-key/{key}     the probe route: 200 with the stored answer, or 404

With --tls-cert PEM --tls-key PEM it serves HTTPS (and says so on a line `tls on` before its
address line).

Prints `listening on http://HOST:PORT` once it accepts connections.
"""

import argparse
import json
import socket
import ssl
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
STATE = {"executions": 0, "by_key": {}, "by_op": {}, "answers": {}, "last": {}}


def operation_of(body):
    """The "op" of a JSON object body, or None."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    op = value.get("op") if isinstance(value, dict) else None
    return op if isinstance(op, str) else None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    dedupe = False

    def log_message(self, fmt, *args):  # quiet: the test's output is the gateway's
        pass

    def send_json(self, status, value, extra=()):
        body = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/__count":
            with LOCK:
                snapshot = {k: STATE[k] for k in ("executions", "by_key", "by_op", "last")}
            return self.send_json(200, snapshot)
        prefix = "/orders/by-key/"
        if self.path.startswith(prefix):
            key = self.path[len(prefix):]
            with LOCK:
                answer = STATE["answers"].get(key)
            if answer is None:
                return self.send_json(404, {"error": "no such order"})
            return self.send_json(200, answer)
        return self.send_json(200, {"path": self.path, "method": "GET"})

    def execute(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        key = (self.headers.get("Idempotency-Key") or "").strip('"')
        with LOCK:
            STATE["last"] = {k.lower(): v for k, v in self.headers.items()}
        if self.headers.get("X-Upstream-Skip") == "1":
            return self.send_json(int(self.headers.get("X-Upstream-Status") or 500), {"error": "not done"})
        with LOCK:
            if self.dedupe and key and key in STATE["answers"]:
                answer = STATE["answers"][key]
                counted = False
            else:
                STATE["executions"] += 1
                n = STATE["executions"]
                if key:
                    STATE["by_key"][key] = STATE["by_key"].get(key, 0) + 1
                op = operation_of(body)
                if op is not None:
                    STATE["by_op"].setdefault(op, []).append(n)
                answer = {"order": n, "path": self.path, "method": self.command, "body": body.decode("utf-8", "replace")}
                if key:
                    STATE["answers"][key] = answer
                counted = True
        delay = int(self.headers.get("X-Upstream-Delay-Ms") or 0)
        if delay:
            time.sleep(delay / 1000)
        if counted and self.headers.get("X-Upstream-Reset") == "1":
            # SO_LINGER 0: close sends RST, the request was done and its answer is lost.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        if counted and self.headers.get("X-Upstream-Stall") == "1":
            self.send_response(201)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'{"order": ')
            self.wfile.flush()
            time.sleep(3600)
            return
        size = self.headers.get("X-Upstream-Size")
        if size is not None:
            data = b"x" * int(size)
            self.send_response(201)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Location", "/orders/%d" % answer["order"])
            self.end_headers()
            self.wfile.write(data)
            return
        status = int(self.headers.get("X-Upstream-Status") or 201)
        self.send_json(status, answer, [("Location", "/orders/%d" % answer["order"])])

    do_POST = do_PUT = do_PATCH = do_DELETE = execute


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--dedupe", action="store_true")
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    args = parser.parse_args()
    host, port = args.listen.rsplit(":", 1)
    Handler.dedupe = args.dedupe
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.request_queue_size = 128
    server = ThreadingHTTPServer((host, int(port)), Handler)
    if args.tls_cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(args.tls_cert, args.tls_key)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        print("tls on https://%s:%d" % server.server_address[:2], flush=True)
    print("listening on http://%s:%d" % server.server_address[:2], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
