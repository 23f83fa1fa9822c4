/**
 * The journal: operation id -> key, request fingerprint, the key's expiry and the final outcome.
 * On Node a file ({@link "./file-journal.js"}); without one (and always in a browser), memory.
 */

import { OperationReused } from "./errors.js";
import type { Bytes } from "./wire.js";

/** The final answer of an operation, as the journal recorded it. */
export interface Outcome {
  readonly status: number;
  /** The kept headers (`KEPT_HEADERS`), lower-case names. */
  readonly headers: Readonly<Record<string, string>>;
  readonly body: Bytes;
  /** When it was recorded (RFC 3339, UTC). */
  readonly finishedAt: string;
}

/** One operation in the journal. */
export interface Entry {
  readonly operation: string;
  readonly key: string;
  readonly fingerprint: string;
  readonly createdAt: string;
  /** The server's `Idempotency-Key-Expires` (milliseconds since the epoch), once an answer carried it. */
  readonly keyExpiresAt?: number | undefined;
  readonly outcome?: Outcome | undefined;
}

/** Where a client keeps its operations. */
export interface Journal {
  /** The entry of `operation`, made with a new key if there is none; {@link OperationReused} if it was begun with another request. */
  begin(operation: string, fingerprint: string): Promise<Entry>;
  /** Records the key's expiry on the server. */
  noteExpiry(operation: string, expiresAt: number): Promise<void>;
  /** Records the final outcome (its `finishedAt` is set by the journal). */
  finish(operation: string, outcome: Omit<Outcome, "finishedAt">): Promise<void>;
}

/** A fresh key for a new operation (a UUIDv4). */
export function newKey(): string {
  return crypto.randomUUID();
}

/** 1 to 128 visible ASCII characters. */
export function validKey(key: string): boolean {
  return /^[\x21-\x7e]{1,128}$/.test(key);
}

/** Checks a begun entry against the request now asked for. */
export function checked(entry: Entry, fingerprint: string): Entry {
  if (entry.fingerprint !== fingerprint) throw new OperationReused(entry.operation);
  return entry;
}

/** A journal that lives as long as its client: operation ids hold within one process only. */
export class MemoryJournal implements Journal {
  readonly #entries = new Map<string, Entry>();

  begin(operation: string, fingerprint: string): Promise<Entry> {
    let entry = this.#entries.get(operation);
    if (entry === undefined) {
      entry = { operation, key: newKey(), fingerprint, createdAt: new Date().toISOString() };
      this.#entries.set(operation, entry);
    }
    return Promise.resolve(checked(entry, fingerprint));
  }

  noteExpiry(operation: string, expiresAt: number): Promise<void> {
    this.#update(operation, { keyExpiresAt: expiresAt });
    return Promise.resolve();
  }

  finish(operation: string, outcome: Omit<Outcome, "finishedAt">): Promise<void> {
    this.#update(operation, { outcome: { ...outcome, finishedAt: new Date().toISOString() } });
    return Promise.resolve();
  }

  #update(operation: string, change: Partial<Entry>): void {
    const entry = this.#entries.get(operation);
    if (entry !== undefined) this.#entries.set(operation, { ...entry, ...change });
  }
}
