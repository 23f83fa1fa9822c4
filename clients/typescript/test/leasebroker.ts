/** The real `leasebroker` binary, started on a free port with its own SQLite database. */

import { spawn, type ChildProcess } from "node:child_process";
import { existsSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

export const TOKEN = "tok-alice-5a8d1c7e90b3";
export const ADMIN = "tok-admin-77c1e0a9d4f2";
// build/test/leasebroker.js -> the workspace root
export const REPO = resolve(dirname(fileURLToPath(import.meta.url)), "../../../..");

/**
 * The workspace binary `name`: `$variable`, else the workspace's debug build; `undefined` (with the
 * reason) when missing. A missing binary skips the test loudly, and fails it under `CI=true`.
 */
export function binary(name = "leasebroker", variable = "LEASEBROKER_BIN"): { path: string } | { missing: string } {
  const target = process.env["CARGO_TARGET_DIR"] ?? join(REPO, "target");
  const path = process.env[variable] ?? join(target, "debug", name);
  if (existsSync(path)) return { path };
  const missing = `${name} binary not found at ${path} (build it: cargo build -p ${name})`;
  if (process.env["CI"] === "true") throw new Error(missing);
  console.error(`SKIPPED: ${missing}`);
  return { missing };
}

/** The sum of the Prometheus counter `name` over its series whose `label` is `value`, in the exposition `text`. */
export function metricTotal(text: string, name: string, label: string, value: string): number {
  let total = 0;
  for (const line of text.split("\n")) {
    if (line.startsWith(`${name}{`) && line.includes(`${label}="${value}"`)) {
      total += Number(line.slice(line.lastIndexOf(" ") + 1));
    }
  }
  return total;
}

export class Leasebroker {
  readonly log: string[] = [];

  private constructor(
    readonly process: ChildProcess,
    readonly url: string,
  ) {}

  static async start(bin: string, directory: string, ...extra: string[]): Promise<Leasebroker> {
    const args = [
      "serve",
      "--listen",
      "127.0.0.1:0",
      "--database",
      `sqlite://${join(directory, "lb.db")}`,
      "--token",
      `${TOKEN}=alice`,
      "--admin-token",
      ADMIN,
      ...(extra.includes("--pool-nodes") ? [] : ["--pool-nodes", "16"]),
      ...extra,
    ];
    const child = spawn(bin, args, { stdio: ["ignore", "pipe", "inherit"] });
    const log: string[] = [];
    const url = await new Promise<string>((found, failed) => {
      const timer = setTimeout(() => {
        child.kill("SIGKILL");
        failed(new Error(`leasebroker did not say it listens within 60 s: ${log.join("")}`));
      }, 60_000);
      createInterface({ input: child.stdout }).on("line", (line) => {
        log.push(line);
        const match = /leasebroker listening on (http:\/\/\S+)/.exec(line);
        if (match?.[1] !== undefined) {
          clearTimeout(timer);
          found(match[1]);
        }
      });
      child.on("exit", (code) => {
        clearTimeout(timer);
        failed(new Error(`leasebroker exited (${String(code)}): ${log.join("\n")}`));
      });
    });
    const broker = new Leasebroker(child, url);
    broker.log.push(...log);
    return broker;
  }

  async admin<T>(path: string): Promise<T> {
    const response = await fetch(this.url + path, { headers: { Authorization: `Bearer ${ADMIN}` } });
    if (!response.ok) throw new Error(`${path}: ${String(response.status)}`);
    return (await response.json()) as T;
  }

  fleet(): Promise<Record<string, number>> {
    return this.admin("/admin/v1/fleet");
  }

  async inFlight(): Promise<{ key: string }[]> {
    return (await this.admin<{ records: { key: string }[] }>("/admin/v1/records?state=in_flight")).records;
  }

  /** `idempotency_requests_total{outcome=...}` from `/metrics`. */
  async requests(outcome: string): Promise<number> {
    return metricTotal(await (await fetch(`${this.url}/metrics`)).text(), "idempotency_requests_total", "outcome", outcome);
  }

  /** `leasebroker_http_responses_total{code=...}` from `/metrics`: the answers it sent with that status. */
  async responses(code: string): Promise<number> {
    return metricTotal(await (await fetch(`${this.url}/metrics`)).text(), "leasebroker_http_responses_total", "code", code);
  }

  async stop(): Promise<void> {
    if (this.process.exitCode !== null || this.process.signalCode !== null) return;
    const exited = new Promise((resolve) => this.process.once("exit", resolve));
    this.process.kill("SIGKILL");
    await exited;
  }
}
