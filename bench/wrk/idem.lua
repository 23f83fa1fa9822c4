-- wrk script: POSTs with an Idempotency-Key.
--   wrk ... -s idem.lua URL -- first|replay NONCE [BODY]
-- first:  a unique key per request ("NONCE-THREAD-N"), so every request is a first execution.
-- replay: one fixed key ("NONCE-replay"): the first request executes, every other one replays.
-- done() prints one JSON line: requests/s, p50/p99 latency (microseconds), errors.

local threads = {}

function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end

function init(args)
  mode = args[1] or "first"
  nonce = args[2] or tostring(os.time())
  counter = 0
  wrk.method = "POST"
  wrk.body = (args[3] ~= nil and args[3] ~= "") and args[3] or '{"image":"worker-base","cpu":16,"memory_gb":64}'
  wrk.headers["Content-Type"] = "application/json"
end

function request()
  local key
  if mode == "replay" then
    key = nonce .. "-replay"
  else
    counter = counter + 1
    key = string.format("%s-%d-%d", nonce, tid, counter)
  end
  wrk.headers["Idempotency-Key"] = '"' .. key .. '"'
  return wrk.format()
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"rps":%.1f,"p50_us":%d,"p99_us":%d,"errors":%d,"errors_status":%d}\n',
    summary.requests, summary.requests / (summary.duration / 1e6),
    latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.timeout + e.status, e.status))
end
