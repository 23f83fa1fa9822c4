/**
 * The real `idempotency-gateway` binary in front of an upstream service that counts its own
 * executions (the gateway's test upstream, `crates/idempotency-gateway/tests/upstreams/upstream.mjs`),
 * each on a free port.
 */

import { spawn, type ChildProcess } from "node:child_process";
import { join } from "node:path";
import { createInterface } from "node:readline";

import { metricTotal, REPO } from "./leasebroker.js";

const UPSTREAM = join(REPO, "crates", "idempotency-gateway", "tests", "upstreams", "upstream.mjs");
const ADMIN = "tok-gateway-admin-3e9b51c0";

/** Starts `command args`, resolving with what the process printed for each of `patterns` (their first group) in order. */
async function started(name: string, command: string, args: string[], patterns: RegExp[]): Promise<{ child: ChildProcess; found: string[] }> {
  const child = spawn(command, args, { stdio: ["ignore", "pipe", "inherit"] });
  const log: string[] = [];
  const found: string[] = [];
  await new Promise<void>((done, failed) => {
    const timer = setTimeout(() => {
      child.kill("SIGKILL");
      failed(new Error(`${name} did not say where it listens within 60 s: ${log.join("\n")}`));
    }, 60_000);
    createInterface({ input: child.stdout }).on("line", (line) => {
      log.push(line);
      const match = patterns[found.length]?.exec(line);
      if (match?.[1] === undefined) return;
      found.push(match[1]);
      if (found.length === patterns.length) {
        clearTimeout(timer);
        done();
      }
    });
    child.on("exit", (code) => {
      clearTimeout(timer);
      failed(new Error(`${name} exited (${String(code)}): ${log.join("\n")}`));
    });
  });
  return { child, found };
}

async function kill(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const exited = new Promise((resolve) => child.once("exit", resolve));
  child.kill("SIGKILL");
  await exited;
}

/** `idempotency-gateway` with a memory record store in front of a counting upstream, both running. */
export class Gateway {
  private constructor(
    private readonly upstream: ChildProcess,
    private readonly gateway: ChildProcess,
    readonly upstreamUrl: string,
    readonly adminUrl: string,
    readonly url: string,
  ) {}

  static async start(bin: string, ...extra: string[]): Promise<Gateway> {
    const upstream = await started("the upstream", process.execPath, [UPSTREAM, "--listen", "127.0.0.1:0"], [/listening on (http:\/\/\S+)/]);
    const [upstreamUrl = ""] = upstream.found;
    const args = ["--upstream", upstreamUrl, "--record-store", "memory", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--admin-token", ADMIN, ...extra];
    try {
      const gateway = await started("idempotency-gateway", bin, args, [/admin on (http:\/\/\S+)/, /idempotency-gateway listening on (http:\/\/\S+)/]);
      const [adminUrl = "", url = ""] = gateway.found;
      return new Gateway(upstream.child, gateway.child, upstreamUrl, adminUrl, url);
    } catch (error) {
      await kill(upstream.child);
      throw error;
    }
  }

  /** How many requests the upstream itself ran. */
  async executions(): Promise<number> {
    return ((await (await fetch(`${this.upstreamUrl}/__count`)).json()) as { executions: number }).executions;
  }

  async inFlight(): Promise<{ key: string }[]> {
    const response = await fetch(`${this.adminUrl}/admin/v1/records?state=in_flight`, { headers: { Authorization: `Bearer ${ADMIN}` } });
    if (!response.ok) throw new Error(`records: ${String(response.status)}`);
    return ((await response.json()) as { records: { key: string }[] }).records;
  }

  /** `idempotency_requests_total{outcome=...}` from the admin listener's `/metrics`. */
  async requests(outcome: string): Promise<number> {
    return metricTotal(await (await fetch(`${this.adminUrl}/metrics`)).text(), "idempotency_requests_total", "outcome", outcome);
  }

  /** Stops the gateway only: the upstream still counts. */
  async stopGateway(): Promise<void> {
    await kill(this.gateway);
  }

  async stop(): Promise<void> {
    await kill(this.gateway);
    await kill(this.upstream);
  }
}
