/**
 * `Client`: one `Idempotency-Key` per logical operation, kept across retries and, with a journal
 * file, across a restart of the process.
 */

import { classify, GaveUp, JournalError, KeyExpired, KeyReused, Refused, RetryableAnswer, isRetryable } from "./errors.js";
import { MemoryJournal, newKey, type Journal, type Outcome } from "./journal.js";
import {
  IDEMPOTENCY_KEY,
  IDEMPOTENT_REPLAYED,
  JOURNAL_HEADER,
  SAFE_METHODS,
  encodeJson,
  fingerprint,
  keptHeaders,
  keyExpires,
  preferWait,
  retryAfterMs,
  type Bytes,
  type Json,
} from "./wire.js";

/** The backoff cap of the first retry; each retry doubles it up to {@link MAX_DELAY_MS} (the Rust SDK's values). */
export const MIN_DELAY_MS = 200;
/** The largest backoff cap. */
export const MAX_DELAY_MS = 30_000;

export interface ClientOptions {
  /** `http://127.0.0.1:8080`, or a base with a path prefix; each request's path is appended to it. */
  readonly baseUrl: string;
  /** Sent on every request (`Authorization`, ...). */
  readonly headers?: Readonly<Record<string, string>>;
  /** A journal file (Node only). Without one, operations are kept in memory for this client's life. */
  readonly journal?: string;
  /** The budget of one call, its retries included (default 10 minutes). */
  readonly maxElapsedMs?: number;
  /** The timeout of one attempt (default 30 s). */
  readonly timeoutMs?: number;
  /** The `fetch` to use (default: the global one). */
  readonly fetch?: typeof fetch;
}

export interface RequestOptions {
  readonly method: string;
  /** The path (and query) after the base URL, starting with `/`. */
  readonly path: string;
  /** A JSON value, sent as `application/json`; `undefined` or `null`: no body. */
  readonly body?: Json | undefined;
  /** The logical operation this request is: its key comes from the journal, and its answer goes there. */
  readonly operation?: string | undefined;
  /** Sends `Prefer: wait=N`: the server may hold the request up to N seconds for a running first attempt. */
  readonly wait?: number | undefined;
}

interface Prepared {
  readonly method: string;
  readonly url: string;
  readonly path: string;
  readonly body: Bytes | undefined;
  readonly headers: Record<string, string>;
  readonly fingerprint: string;
  readonly waitMs: number;
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/** The retries of one call: the key, the budget, the backoff and the key's expiry. */
class Attempts {
  count = 0;
  readonly #start = Date.now();
  #cap = MIN_DELAY_MS;

  constructor(
    readonly key: string | undefined,
    readonly maxElapsedMs: number,
    readonly timeoutMs: number,
    /** When the server forgets the key (`Idempotency-Key-Expires`), milliseconds since the epoch. */
    public expiresAt: number | undefined,
  ) {}

  elapsed(): number {
    return Date.now() - this.#start;
  }

  /** Before an attempt: its headers and timeout. Throws {@link KeyExpired} when the server has forgotten the key. */
  begin(request: Prepared): { headers: Record<string, string>; timeoutMs: number } {
    if (this.key !== undefined && this.expiresAt !== undefined && Date.now() >= this.expiresAt) {
      throw new KeyExpired(this.key, this.expiresAt);
    }
    this.count += 1;
    const headers = { ...request.headers, ...(this.key === undefined ? {} : { [IDEMPOTENCY_KEY]: this.key }) };
    const remaining = this.maxElapsedMs - this.elapsed();
    return { headers, timeoutMs: Math.max(1, Math.min(this.timeoutMs + request.waitMs, remaining)) };
  }

  /** Takes the key's expiry from an answer; whether it changed. */
  note(headers: Headers): boolean {
    const expires = keyExpires(headers);
    if (expires === undefined || expires === this.expiresAt || this.key === undefined) return false;
    this.expiresAt = expires;
    return true;
  }

  /**
   * The wait before the next attempt after `error`. Throws `error` when it is final, {@link GaveUp}
   * when the budget has no room for another attempt, {@link KeyExpired} when the key expires first.
   */
  pause(error: Error): number {
    if (!isRetryable(error)) throw error;
    const jittered = Math.random() * this.#cap; // full jitter
    this.#cap = Math.min(this.#cap * 2, MAX_DELAY_MS);
    const asked = error instanceof RetryableAnswer ? error.retryAfterMs : undefined;
    // The server knows when it will be ready: waiting less than it asked only earns another 503.
    const wait = asked === undefined ? jittered : Math.max(jittered, asked);
    // An attempt that starts at the deadline has no time left to run.
    if (this.elapsed() + wait >= this.maxElapsedMs) throw new GaveUp(this.count, this.elapsed(), error);
    if (this.key !== undefined && this.expiresAt !== undefined && Date.now() + wait >= this.expiresAt) {
      throw new KeyExpired(this.key, this.expiresAt);
    }
    return wait;
  }
}

const NULL_BODY_STATUSES = new Set([101, 103, 204, 205, 304]);

/**
 * The answer the journal holds, as the response it was: its status, its kept headers (with
 * `Idempotent-Replayed: true` and `Idempotency-Client-Journal: <when recorded>`) and its body. A
 * recorded refusal is thrown again, as it was thrown the first time.
 */
function fromJournal(outcome: Outcome): Response {
  const headers = new Headers(outcome.headers);
  headers.set(IDEMPOTENT_REPLAYED, "true");
  headers.set(JOURNAL_HEADER, outcome.finishedAt);
  const body = NULL_BODY_STATUSES.has(outcome.status) ? null : outcome.body;
  const response = new Response(body, { status: outcome.status, headers });
  const error = classify(response, outcome.body, undefined);
  if (error !== undefined) throw error;
  return response;
}

/**
 * What the journal records of an answer: a success, or a refusal that no retry changes (a 4xx, a
 * reused key). Not a 401/403 (the caller may fix the credentials) and nothing retryable.
 */
function isFinal(error: Error | undefined): boolean {
  return error === undefined || error instanceof Refused || error instanceof KeyReused;
}

function asError(thrown: unknown): Error {
  return thrown instanceof Error ? thrown : new Error(String(thrown));
}

export class Client {
  readonly #base: string;
  readonly #headers: Readonly<Record<string, string>>;
  readonly #journalPath: string | undefined;
  #journal: Promise<Journal> | undefined;
  readonly #maxElapsedMs: number;
  readonly #timeoutMs: number;
  readonly #fetch: typeof fetch;

  constructor(options: ClientOptions) {
    const base = new URL(options.baseUrl);
    if (!["http:", "https:"].includes(base.protocol) || base.search !== "" || base.hash !== "") {
      throw new TypeError(`baseUrl ${JSON.stringify(options.baseUrl)} is not an http(s) URL without a query`);
    }
    const maxElapsedMs = options.maxElapsedMs ?? 600_000;
    const timeoutMs = options.timeoutMs ?? 30_000;
    if (!(maxElapsedMs > 0 && timeoutMs > 0)) throw new RangeError("maxElapsedMs and timeoutMs are positive numbers");
    this.#base = base.href.replace(/\/$/, "");
    this.#headers = { ...options.headers };
    this.#journalPath = options.journal;
    this.#maxElapsedMs = maxElapsedMs;
    this.#timeoutMs = timeoutMs;
    this.#fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
  }

  /**
   * Sends `method path` (`body` as JSON) until it succeeds, is refused, or the budget runs out; with
   * `operation`, under the journal's key for that operation.
   */
  async request(options: RequestOptions): Promise<Response> {
    const request = await this.#prepare(options);
    const operation = options.operation;
    const journal = operation === undefined ? undefined : await this.#openJournal();
    let attempts: Attempts;
    if (journal !== undefined && operation !== undefined) {
      const entry = await journal.begin(operation, request.fingerprint);
      if (entry.outcome !== undefined) return fromJournal(entry.outcome);
      attempts = new Attempts(entry.key, this.#maxElapsedMs, this.#timeoutMs, entry.keyExpiresAt);
    } else {
      // Without an operation id the key lives for this call's retries only.
      const key = SAFE_METHODS.has(request.method) ? undefined : newKey();
      attempts = new Attempts(key, this.#maxElapsedMs, this.#timeoutMs, undefined);
    }
    for (;;) {
      const { headers, timeoutMs } = attempts.begin(request);
      let response: Response;
      let body: Bytes;
      try {
        response = await this.#fetch(request.url, {
          method: request.method,
          headers,
          body: request.body ?? null,
          redirect: "manual", // a followed redirect would send a mutation somewhere else
          signal: AbortSignal.timeout(timeoutMs),
        });
        // Read a copy: the caller gets the response with its body unread.
        body = new Uint8Array(await response.clone().arrayBuffer());
      } catch (thrown) {
        await sleep(attempts.pause(asError(thrown)));
        continue;
      }
      if (attempts.note(response.headers) && journal !== undefined && operation !== undefined && attempts.expiresAt !== undefined) {
        await journal.noteExpiry(operation, attempts.expiresAt);
      }
      const error = classify(response, body, retryAfterMs(response.headers));
      if (journal !== undefined && operation !== undefined && isFinal(error)) {
        await journal.finish(operation, { status: response.status, headers: keptHeaders(response.headers), body });
      }
      if (error === undefined) return response;
      await sleep(attempts.pause(error));
    }
  }

  async #prepare(options: RequestOptions): Promise<Prepared> {
    const method = options.method.toUpperCase();
    if (!options.path.startsWith("/")) throw new TypeError(`path must start with '/', got ${JSON.stringify(options.path)}`);
    if (options.operation !== undefined && (SAFE_METHODS.has(method) || options.operation === "")) {
      throw new TypeError(`an operation id names a mutation (POST, PUT, PATCH, DELETE), not ${method}`);
    }
    const body = options.body === undefined || options.body === null ? undefined : encodeJson(options.body);
    const headers: Record<string, string> = { Accept: "application/json", ...this.#headers };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    if (options.wait !== undefined) headers["Prefer"] = preferWait(options.wait);
    return {
      method,
      url: `${this.#base}${options.path}`,
      path: options.path,
      body,
      headers,
      fingerprint: await fingerprint(method, options.path, body ?? new Uint8Array()),
      waitMs: (options.wait ?? 0) * 1000,
    };
  }

  #openJournal(): Promise<Journal> {
    this.#journal ??= this.#makeJournal().catch((error: unknown) => {
      this.#journal = undefined; // a fixed file (chmod) is picked up by the next request
      throw error;
    });
    return this.#journal;
  }

  async #makeJournal(): Promise<Journal> {
    const path = this.#journalPath;
    if (path === undefined) return new MemoryJournal();
    if (typeof process === "undefined" || typeof process.versions.node !== "string") {
      throw new JournalError("a journal file needs Node; in a browser leave `journal` out (memory)");
    }
    const { FileJournal } = await import("./file-journal.js");
    return FileJournal.open(path);
  }
}
