/**
 * The journal as a JSON file on Node, shared safely by several processes.
 *
 * Every change is a read-modify-write under a lock file (`PATH.lock`, made with O_EXCL), written to
 * a temporary file (0600) that is synced and then renamed over the journal, so a reader sees the old
 * file or the new one, never half of one, and a crash loses nothing committed. A new entry is written
 * (and synced) before the first attempt goes out. A lock whose owner died is broken: at once when
 * the owner was a process of this machine that no longer runs, otherwise after {@link STALE_MS}.
 */

import { link, mkdir, open, readFile, rename, stat, unlink } from "node:fs/promises";
import { hostname } from "node:os";
import { dirname } from "node:path";

import { JournalError } from "./errors.js";
import { checked, newKey, validKey, type Entry, type Journal, type Outcome } from "./journal.js";

/** How long a writer waits for another process's lock before failing. */
export const LOCK_WAIT_MS = 30_000;
/** A lock older than this is broken whoever holds it: it guards one small write, which takes milliseconds. */
export const STALE_MS = 10_000;
const FORMAT = "idempotency-client-journal";

/** One operation, named like the columns of the Python client's SQLite journal. */
interface Row {
  idem_key: string;
  fingerprint: string;
  created_at: string;
  key_expires_at?: string | null;
  outcome_status?: number | null;
  outcome_headers?: Record<string, string> | null;
  outcome_body_base64?: string | null;
  finished_at?: string | null;
}

type Rows = Map<string, Row>;

/** The lock was broken (its owner stalled past {@link STALE_MS}) before the write landed: try again. */
class LockLost extends Error {}

function code(error: unknown): unknown {
  return (error as { code?: unknown } | null)?.code;
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

export class FileJournal implements Journal {
  readonly #lock: string;

  private constructor(readonly path: string) {
    this.#lock = `${path}.lock`;
  }

  /** Opens (making its missing directories, 0700) the journal at `path`; refuses an exposed file. */
  static async open(path: string): Promise<FileJournal> {
    try {
      await mkdir(dirname(path), { recursive: true, mode: 0o700 });
    } catch (error) {
      throw new JournalError(`cannot create the directory of ${path}: ${String(error)}`);
    }
    const journal = new FileJournal(path);
    await journal.#refuseExposed();
    await journal.#read(); // a damaged file is an error now, not at the first request
    return journal;
  }

  async begin(operation: string, fingerprint: string): Promise<Entry> {
    const found = (await this.#read()).get(operation);
    if (found !== undefined) return checked(entry(operation, found), fingerprint);
    const row = await this.#update((rows) => {
      const existing = rows.get(operation);
      if (existing !== undefined) return { row: existing, changed: false };
      const row: Row = { idem_key: newKey(), fingerprint, created_at: new Date().toISOString() };
      rows.set(operation, row);
      return { row, changed: true };
    });
    return checked(entry(operation, row), fingerprint);
  }

  async noteExpiry(operation: string, expiresAt: number): Promise<void> {
    await this.#change(operation, { key_expires_at: new Date(expiresAt).toISOString() });
  }

  async finish(operation: string, outcome: Omit<Outcome, "finishedAt">): Promise<void> {
    await this.#change(operation, {
      outcome_status: outcome.status,
      outcome_headers: { ...outcome.headers },
      outcome_body_base64: Buffer.from(outcome.body).toString("base64"),
      finished_at: new Date().toISOString(),
    });
  }

  async #change(operation: string, change: Partial<Row>): Promise<void> {
    await this.#update((rows) => {
      const row = rows.get(operation);
      if (row === undefined) throw new JournalError(`operation ${JSON.stringify(operation)} is not in the journal ${this.path}`);
      rows.set(operation, { ...row, ...change });
      return { row, changed: true };
    });
  }

  async #refuseExposed(): Promise<void> {
    let mode: number;
    try {
      mode = (await stat(this.path)).mode & 0o777;
    } catch (error) {
      if (code(error) === "ENOENT") return;
      throw new JournalError(`cannot read ${this.path}: ${String(error)}`);
    }
    if ((mode & 0o077) !== 0) {
      const octal = mode.toString(8).padStart(3, "0");
      throw new JournalError(
        `${this.path} is readable or writable by group or others (mode ${octal}); make it owner-only with \`chmod 600 ${this.path}\``,
      );
    }
  }

  async #read(): Promise<Rows> {
    let text: string;
    try {
      text = await readFile(this.path, "utf8");
    } catch (error) {
      if (code(error) === "ENOENT") return new Map();
      throw new JournalError(`cannot read ${this.path}: ${String(error)}`);
    }
    let parsed: unknown;
    try {
      parsed = JSON.parse(text);
    } catch (error) {
      throw new JournalError(`${this.path} is not a journal: ${String(error)}`);
    }
    const file = parsed as { format?: unknown; operations?: unknown } | null;
    if (file?.format !== FORMAT || typeof file.operations !== "object" || file.operations === null) {
      throw new JournalError(`${this.path} is not a journal of this client (no "format": "${FORMAT}")`);
    }
    return new Map(Object.entries(file.operations as Record<string, Row>));
  }

  /** Read, change and write the file under the lock; the write is skipped when nothing changed. */
  async #update<T>(change: (rows: Rows) => { row: T; changed: boolean }): Promise<T> {
    for (;;) {
      const token = await this.#acquire();
      try {
        const rows = await this.#read();
        const { row, changed } = change(rows);
        if (changed) await this.#write(rows, token);
        return row;
      } catch (error) {
        if (!(error instanceof LockLost)) throw error;
      } finally {
        await this.#release(token);
      }
    }
  }

  async #write(rows: Rows, token: string): Promise<void> {
    const text = JSON.stringify({ format: FORMAT, version: 1, operations: Object.fromEntries(rows) }, null, 1);
    const temporary = `${this.path}.${String(process.pid)}.${newKey()}.tmp`;
    const file = await open(temporary, "wx", 0o600);
    try {
      await file.writeFile(text);
      await file.sync();
    } finally {
      await file.close();
    }
    if (!(await this.#holds(token))) {
      await unlink(temporary);
      throw new LockLost();
    }
    await rename(temporary, this.path);
    await syncDirectory(dirname(this.path));
  }

  async #acquire(): Promise<string> {
    const token = `${String(process.pid)} ${hostname()} ${newKey()}`;
    const deadline = Date.now() + LOCK_WAIT_MS;
    for (let delay = 2; ; delay = Math.min(delay * 2, 100)) {
      try {
        const file = await open(this.#lock, "wx", 0o600);
        try {
          await file.writeFile(token);
        } finally {
          await file.close();
        }
        return token;
      } catch (error) {
        if (code(error) !== "EEXIST") throw new JournalError(`cannot lock ${this.path}: ${String(error)}`);
      }
      if (await this.#breakStale()) continue;
      if (Date.now() > deadline) {
        throw new JournalError(`${this.#lock} was held for over ${String(LOCK_WAIT_MS / 1000)} s; if no client runs, remove it`);
      }
      await sleep(delay * (0.5 + Math.random()));
    }
  }

  /** Breaks the lock if its owner is gone; whether the lock may now be free. */
  async #breakStale(): Promise<boolean> {
    let content: string;
    let age: number;
    try {
      content = await readFile(this.#lock, "utf8");
      age = Date.now() - (await stat(this.#lock)).mtimeMs;
    } catch (error) {
      if (code(error) === "ENOENT") return true;
      throw new JournalError(`cannot read the lock ${this.#lock}: ${String(error)}`);
    }
    if (!stale(content, age)) return false;
    // Move it aside and look at what was moved: another process may have broken the same stale
    // lock and taken a fresh one in between, and a fresh lock is put back.
    const aside = `${this.#lock}.${newKey()}.stale`;
    try {
      await rename(this.#lock, aside);
    } catch (error) {
      if (code(error) === "ENOENT") return true;
      throw new JournalError(`cannot break the stale lock ${this.#lock}: ${String(error)}`);
    }
    const moved = await readFile(aside, "utf8").catch(() => content);
    if (moved !== content) await link(aside, this.#lock).catch(() => undefined);
    await unlink(aside).catch(() => undefined);
    return true;
  }

  async #holds(token: string): Promise<boolean> {
    return (await readFile(this.#lock, "utf8").catch(() => "")) === token;
  }

  async #release(token: string): Promise<void> {
    if (await this.#holds(token)) await unlink(this.#lock).catch(() => undefined);
  }
}

/** Whether a lock's owner is gone: a process of this machine that no longer runs, or a lock past {@link STALE_MS}. */
export function stale(content: string, age: number): boolean {
  if (age > STALE_MS) return true;
  const [pid, host] = content.split(" ");
  if (host !== hostname() || pid === undefined || !/^\d+$/.test(pid)) return false;
  try {
    process.kill(Number(pid), 0);
    return false;
  } catch (error) {
    return code(error) === "ESRCH";
  }
}

async function syncDirectory(directory: string): Promise<void> {
  // The rename is durable once the directory is synced; not every platform lets a directory be opened.
  const handle = await open(directory, "r").catch(() => undefined);
  if (handle === undefined) return;
  try {
    await handle.sync().catch(() => undefined);
  } finally {
    await handle.close();
  }
}

function entry(operation: string, row: Row): Entry {
  if (typeof row.idem_key !== "string" || !validKey(row.idem_key)) {
    throw new JournalError(`operation ${JSON.stringify(operation)} has a corrupt key in the journal`);
  }
  const expires = typeof row.key_expires_at === "string" ? Date.parse(row.key_expires_at) : Number.NaN;
  const done = typeof row.outcome_status === "number" && typeof row.finished_at === "string";
  return {
    operation,
    key: row.idem_key,
    fingerprint: row.fingerprint,
    createdAt: row.created_at,
    keyExpiresAt: Number.isNaN(expires) ? undefined : expires,
    outcome: done
      ? {
          status: row.outcome_status as number,
          headers: row.outcome_headers ?? {},
          body: new Uint8Array(Buffer.from(row.outcome_body_base64 ?? "", "base64")),
          finishedAt: row.finished_at as string,
        }
      : undefined,
  };
}
