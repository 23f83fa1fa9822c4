/**
 * An HTTP client that keeps one `Idempotency-Key` per logical operation.
 *
 * ```ts
 * import { Client } from "idempotency-client";
 *
 * const client = new Client({ baseUrl: "http://127.0.0.1:8080", headers: { Authorization: "Bearer TOKEN" }, journal: "journal.json" });
 * const response = await client.request({ method: "POST", path: "/v1/workers", body: { image: "base", cpu: 2, memory_gb: 4 }, operation: "nightly-ci-4711" });
 * ```
 *
 * Retried: connection errors, timeouts, 5xx, 429 and `409 request-in-progress`, with exponential
 * backoff and full jitter, at least as long as `Retry-After` asks, within `maxElapsedMs`. Never
 * retried: `idempotency-key-reused` ({@link KeyReused}), 401/403 ({@link Unauthorized}) and every
 * other 4xx ({@link Refused}).
 *
 * @packageDocumentation
 */

export { Client, MAX_DELAY_MS, MIN_DELAY_MS, type ClientOptions, type RequestOptions } from "./client.js";
export {
  AnsweredError,
  GaveUp,
  IdempotencyError,
  InProgress,
  JournalError,
  KeyExpired,
  KeyReused,
  OperationReused,
  Refused,
  RetryableAnswer,
  ServerError,
  Unauthorized,
  problemName,
  type Problem,
} from "./errors.js";
export { JOURNAL_HEADER, type Json } from "./wire.js";
