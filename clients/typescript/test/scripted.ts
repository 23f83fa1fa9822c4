/**
 * A scripted HTTP API on loopback (node:http only): it answers each request with the next reply of
 * its script and records what arrived, when, and with which key.
 */

import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";

/** Close the connection without answering: the answer is lost. */
export const DROP = "drop";

export interface Reply {
  readonly status: number;
  readonly headers?: Readonly<Record<string, string>>;
  readonly body?: string;
}

export interface Arrival {
  /** performance.now() */
  readonly at: number;
  /** Date.now() */
  readonly wall: number;
  readonly method: string;
  readonly path: string;
  /** Lower-case names. */
  readonly headers: Readonly<Record<string, string | undefined>>;
  readonly body: string;
  readonly key: string | undefined;
}

export type Step = Reply | typeof DROP | ((arrival: Arrival) => Reply);

/** An RFC 9457 problem reply. */
export function problem(status: number, name: string, headers: Record<string, string> = {}): Reply {
  const body = JSON.stringify({ type: `/problems/${name}`, title: name, status });
  return { status, headers: { "Content-Type": "application/problem+json", ...headers }, body };
}

export function created(body: unknown, headers: Record<string, string> = {}): Reply {
  return { status: 201, headers: { "Content-Type": "application/json", ...headers }, body: JSON.stringify(body) };
}

export class Scripted {
  readonly arrivals: Arrival[] = [];
  connections = 0;
  url = "";
  readonly #server: Server;

  /** `steps` answer the first, second, ... request; the last one repeats. */
  private constructor(readonly steps: readonly Step[]) {
    this.#server = createServer((request, response) => {
      void this.#answer(request, response);
    });
    this.#server.on("connection", () => {
      this.connections += 1;
    });
  }

  static async start(steps: readonly Step[]): Promise<Scripted> {
    const scripted = new Scripted(steps);
    await new Promise<void>((resolve) => scripted.#server.listen(0, "127.0.0.1", resolve));
    scripted.url = `http://127.0.0.1:${String((scripted.#server.address() as AddressInfo).port)}`;
    return scripted;
  }

  get keys(): (string | undefined)[] {
    return this.arrivals.map((a) => a.key);
  }

  async #answer(request: IncomingMessage, response: ServerResponse): Promise<void> {
    const chunks: Buffer[] = [];
    for await (const chunk of request) chunks.push(chunk as Buffer);
    const headers: Record<string, string | undefined> = {};
    for (const [name, value] of Object.entries(request.headers)) headers[name] = Array.isArray(value) ? value.join(", ") : value;
    const arrival: Arrival = {
      at: performance.now(),
      wall: Date.now(),
      method: request.method ?? "",
      path: request.url ?? "",
      headers,
      body: Buffer.concat(chunks).toString("utf8"),
      key: headers["idempotency-key"],
    };
    this.arrivals.push(arrival);
    const step = this.steps[Math.min(this.arrivals.length, this.steps.length) - 1] ?? DROP;
    if (step === DROP) {
      request.socket.destroy();
      return;
    }
    const reply = typeof step === "function" ? step(arrival) : step;
    response.writeHead(reply.status, { ...reply.headers });
    response.end(reply.body ?? "");
  }

  async close(): Promise<void> {
    this.#server.closeAllConnections();
    await new Promise<void>((resolve) => this.#server.close(() => { resolve(); }));
  }
}

/** Runs `body` with a scripted API, closed afterwards. */
export async function scripted<T>(steps: readonly Step[], body: (api: Scripted) => Promise<T>): Promise<T> {
  const api = await Scripted.start(steps);
  try {
    return await body(api);
  } finally {
    await api.close();
  }
}
