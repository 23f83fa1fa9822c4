/**
 * What goes on the wire and what comes back, without I/O: the body, the fingerprint, the headers.
 */

export const IDEMPOTENCY_KEY = "Idempotency-Key";
export const IDEMPOTENCY_KEY_EXPIRES = "Idempotency-Key-Expires";
export const IDEMPOTENT_REPLAYED = "Idempotent-Replayed";
/** Set on a response answered from the journal (nothing was sent); its value is when the outcome was recorded. */
export const JOURNAL_HEADER = "Idempotency-Client-Journal";
/** The response headers the journal keeps with an outcome, so an answer from the journal carries them. */
export const KEPT_HEADERS = ["content-type", "location", "content-location", "etag", "idempotency-key-expires"];
/** Methods that are idempotent by nature: retried without a key, never journaled. */
export const SAFE_METHODS: ReadonlySet<string> = new Set(["GET", "HEAD", "OPTIONS"]);

/** Bytes in memory (what `fetch` and `Response` take as a body). */
export type Bytes = Uint8Array<ArrayBuffer>;

/** A JSON value, as `body`. */
export type Json = null | boolean | number | string | readonly Json[] | { readonly [key: string]: Json };

function sorted(value: Json): Json {
  // JSON.stringify would write NaN and Infinity as null: a value JSON cannot carry is refused.
  if (typeof value === "number" && !Number.isFinite(value)) {
    throw new TypeError(`body holds ${String(value)}, which JSON cannot carry`);
  }
  if (Array.isArray(value)) return value.map(sorted);
  if (typeof value === "object" && value !== null) {
    const object = value as { readonly [key: string]: Json };
    return Object.fromEntries(Object.keys(object).sort().map((key) => [key, sorted(object[key] ?? null)]));
  }
  return value;
}

/**
 * The body sent for a JSON value: compact, keys sorted, UTF-8, so one value is always the same bytes
 * (the server fingerprints the bytes; a rerun must send exactly what the first run did).
 */
export function encodeJson(value: Json): Bytes {
  return new TextEncoder().encode(JSON.stringify(sorted(value)));
}

/**
 * SHA-256 of the method, the path and the body, as `sha256:<hex>` (the Python client's and the Rust
 * SDK's fingerprint: the same request gets the same fingerprint in all three).
 */
export async function fingerprint(method: string, path: string, body: Uint8Array): Promise<string> {
  const head = new TextEncoder().encode(`${method} ${path}\n`);
  const data = new Uint8Array(head.length + body.length);
  data.set(head);
  data.set(body, head.length);
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", data));
  return `sha256:${Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}

/** An HTTP-date as milliseconds since the epoch. */
export function httpDate(value: string): number | undefined {
  const at = Date.parse(value.trim());
  return Number.isNaN(at) ? undefined : at;
}

/** `Retry-After` in milliseconds: delay-seconds, or an HTTP-date (RFC 9110 10.2.3), never negative. */
export function retryAfterMs(headers: Headers, now: number = Date.now()): number | undefined {
  const value = headers.get("retry-after")?.trim();
  if (value === undefined) return undefined;
  if (/^\d+$/.test(value)) return Number(value) * 1000;
  const at = httpDate(value);
  return at === undefined ? undefined : Math.max(0, at - now);
}

/** `Idempotency-Key-Expires` in milliseconds since the epoch. */
export function keyExpires(headers: Headers): number | undefined {
  const value = headers.get(IDEMPOTENCY_KEY_EXPIRES);
  return value === null ? undefined : httpDate(value);
}

/** The `Prefer` header for a wait in seconds (RFC 7240 takes whole seconds: rounded up). */
export function preferWait(wait: number): string {
  if (!Number.isFinite(wait) || wait < 0) throw new RangeError(`wait must be a non-negative number of seconds, got ${String(wait)}`);
  return `wait=${String(Math.ceil(wait))}`;
}

/** The headers the journal keeps with an outcome. */
export function keptHeaders(headers: Headers): Record<string, string> {
  const kept: Record<string, string> = {};
  for (const name of KEPT_HEADERS) {
    const value = headers.get(name);
    if (value !== null) kept[name] = value;
  }
  return kept;
}
