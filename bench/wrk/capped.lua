-- idem.lua with a cap: each wrk thread stops after CAP responses.
--   wrk ... -s bench/wrk/capped.lua URL -- first|replay NONCE BODY CAP
-- (run from the repository's root). A capped run's req/s also counts the idle rest of the run;
-- its latencies stand. A separate script because a `response` function makes wrk hand every
-- response to Lua, which the uncapped runs should not pay for.
dofile("bench/wrk/idem.lua")

local idem_init = init

function init(args)
  idem_init(args)
  cap = tonumber(args[4]) or error("capped.lua: the fourth argument, CAP, must be a number")
  answered = 0
end

function response(status, headers, body)
  answered = answered + 1
  if answered >= cap then wrk.thread:stop() end
end
