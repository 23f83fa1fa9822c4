/**
 * The errors a request can end with, shaped by what the caller does next, and RFC 9457 problems.
 */

/** The problem a server sends when a key comes back with a different request (409, 422 or 400). */
export const KEY_REUSED = "idempotency-key-reused";
/** The problem a server sends while the first request with a key is still running (409). */
export const IN_PROGRESS = "request-in-progress";

/** An RFC 9457 problem details object, as a server sends it with `application/problem+json`. */
export interface Problem {
  /** A URI naming the problem; its last path segment is the short name (`idempotency-key-reused`). */
  readonly type: string;
  readonly title?: string;
  readonly status?: number;
  readonly detail?: string;
  /** Extension members, as received. */
  readonly [member: string]: unknown;
}

/** The short name of a problem: the last `/`-separated segment of its `type`. */
export function problemName(problem: Problem): string {
  return problem.type.slice(problem.type.lastIndexOf("/") + 1);
}

/** Parses a response body; `undefined` when it is not a JSON object. */
export function parseProblem(body: Uint8Array): Problem | undefined {
  let value: unknown;
  try {
    value = JSON.parse(new TextDecoder().decode(body));
  } catch {
    return undefined;
  }
  if (typeof value !== "object" || value === null || Array.isArray(value)) return undefined;
  const members = value as Record<string, unknown>;
  return { ...members, type: typeof members["type"] === "string" ? members["type"] : "about:blank" };
}

function describe(problem: Problem | undefined): string {
  if (problem === undefined) return "";
  const text = typeof problem.detail === "string" ? problem.detail : problem.title;
  return typeof text === "string" ? `: ${problemName(problem)}: ${text}` : `: ${problemName(problem)}`;
}

/** The base of every error this package throws. */
export class IdempotencyError extends Error {
  override name = "IdempotencyError";
}

/** An error that is a server's answer: its status, its parsed problem, and the response. */
export abstract class AnsweredError extends IdempotencyError {
  readonly status: number;
  readonly problem: Problem | undefined;

  /** `response` is the answer as received; its body is still unread. */
  constructor(
    what: string,
    readonly response: Response,
    body: Uint8Array,
  ) {
    const problem = parseProblem(body);
    super(`${what} (${String(response.status)})${describe(problem)}`);
    this.status = response.status;
    this.problem = problem;
  }
}

/**
 * The key was first used with a different request (problem `idempotency-key-reused`, whatever its
 * status: 409, 422 or 400). A bug in the caller: never retried.
 */
export class KeyReused extends AnsweredError {
  override name = "KeyReused";
  constructor(response: Response, body: Uint8Array) {
    super("idempotency key reused with a different request", response, body);
  }
}

/** The server made a permanent decision against the request (a 4xx such as 400, 404, 409 or 422). Never retried. */
export class Refused extends AnsweredError {
  override name = "Refused";
  constructor(response: Response, body: Uint8Array) {
    super("refused", response, body);
  }
}

/** The credentials were missing, wrong or not allowed (401 or 403). Never retried. */
export class Unauthorized extends AnsweredError {
  override name = "Unauthorized";
  constructor(response: Response, body: Uint8Array) {
    super("unauthorized", response, body);
  }
}

/** An answer worth retrying, with the wait the server asked for. */
export abstract class RetryableAnswer extends AnsweredError {
  constructor(
    what: string,
    response: Response,
    body: Uint8Array,
    /** `Retry-After`, in milliseconds. */
    readonly retryAfterMs: number | undefined,
  ) {
    super(what, response, body);
  }
}

/** The server failed or shed load (5xx or 429): retried, and found in {@link GaveUp.last}. */
export class ServerError extends RetryableAnswer {
  override name = "ServerError";
  constructor(response: Response, body: Uint8Array, retryAfterMs: number | undefined) {
    super("server error", response, body, retryAfterMs);
  }
}

/** The first request with this key is still running (409 `request-in-progress`): retried, and found in {@link GaveUp.last}. */
export class InProgress extends RetryableAnswer {
  override name = "InProgress";
  constructor(response: Response, body: Uint8Array, retryAfterMs: number | undefined) {
    super("in progress", response, body, retryAfterMs);
  }
}

/**
 * The budget (`maxElapsedMs`) ran out while the errors were retryable. The operation may or may not
 * have happened: run it again with the same operation id to find out.
 */
export class GaveUp extends IdempotencyError {
  override name = "GaveUp";
  constructor(
    readonly attempts: number,
    readonly elapsedMs: number,
    /** The last attempt's error: a {@link ServerError}, an {@link InProgress}, or what `fetch` threw. */
    readonly last: Error,
  ) {
    super(`gave up after ${String(attempts)} attempts in ${(elapsedMs / 1000).toFixed(1)}s; last error: ${describeError(last)}`);
  }
}

/**
 * The server's record of the key has expired (its `Idempotency-Key-Expires` has passed), so a
 * request with it would run as a new operation: it is never sent again.
 */
export class KeyExpired extends IdempotencyError {
  override name = "KeyExpired";
  constructor(
    readonly key: string,
    /** When the key expired, in milliseconds since the epoch. */
    readonly expiredAt: number,
  ) {
    super(`idempotency key ${key} expired on the server; not sent (use a new operation id)`);
  }
}

/** The operation id is journaled for a different request (method, path or body). Nothing was sent. */
export class OperationReused extends IdempotencyError {
  override name = "OperationReused";
  constructor(readonly operation: string) {
    super(`operation ${JSON.stringify(operation)} was first used with a different request; not sent (use a new operation id)`);
  }
}

/** The journal cannot be used: an exposed file, a damaged entry, a lock held too long. */
export class JournalError extends IdempotencyError {
  override name = "JournalError";
}

/**
 * The error a complete answer is; `undefined` for a success (2xx). The problem type decides before
 * the status does: the reused-key status is configurable on the server (409, 422 or 400), and 409
 * also means "in progress" or a conflict the handler decided.
 */
export function classify(response: Response, body: Uint8Array, retryAfterMs: number | undefined): AnsweredError | undefined {
  const status = response.status;
  if (status >= 200 && status < 300) return undefined;
  const problem = parseProblem(body);
  const name = problem === undefined ? undefined : problemName(problem);
  if (name === KEY_REUSED) return new KeyReused(response, body);
  if (status === 409 && name === IN_PROGRESS) return new InProgress(response, body, retryAfterMs);
  if (status === 401 || status === 403) return new Unauthorized(response, body);
  if (status === 429 || status >= 500) return new ServerError(response, body, retryAfterMs);
  return new Refused(response, body);
}

/** Whether sending the same request again, with the same key, may succeed. */
export function isRetryable(error: unknown): boolean {
  if (error instanceof RetryableAnswer) return true;
  if (error instanceof IdempotencyError) return false;
  // What fetch throws: a TypeError for a network failure, a DOMException for the attempt's timeout.
  if (!(error instanceof Error)) return false;
  return !isTlsFailure(error);
}

/** A TLS failure is not retried: an untrusted certificate does not become trusted by asking again. */
function isTlsFailure(error: Error): boolean {
  for (let cause: unknown = error; cause instanceof Error; cause = cause.cause) {
    const code = (cause as { code?: unknown }).code;
    if (typeof code === "string" && /SSL|TLS|CERT/.test(code)) return true;
  }
  return false;
}

function describeError(error: Error): string {
  const cause = error.cause instanceof Error ? `: ${error.cause.message}` : "";
  return `${error.message}${cause}`;
}
