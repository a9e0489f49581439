-- The owner record (docs/redis-keys.md): one string, a field per line, in
-- this order; the task id, last, is the rest of the string:
--   exec handoff copies token at lease fin retries pid hostkey host name task
-- (replies.RECORD_FIELDS reads it in Python). Every script begins with this
-- prelude, so the layout is written once: each pattern below is named for
-- what it captures, a literal, so a script pays nothing to have it.
local RECORD_EXEC_HANDOFF = '^([^\n]*)\n([^\n]*)\n'
local RECORD_EXEC_COPIES = '^([^\n]*)\n[^\n]*\n([^\n]*)\n'
local RECORD_EXEC_TOKEN = '^([^\n]*)\n[^\n]*\n[^\n]*\n([^\n]*)\n'
local RECORD_HEAD = '^([^\n]*)\n([^\n]*)\n([^\n]*)\n([^\n]*)\n'
local RECORD_TOKEN = '^[^\n]*\n[^\n]*\n[^\n]*\n([^\n]*)'
local RECORD_FIN_TASK = '^[^\n]*\n[^\n]*\n[^\n]*\n[^\n]*\n[^\n]*\n[^\n]*\n([^\n]*)\n' ..
  '[^\n]*\n[^\n]*\n[^\n]*\n[^\n]*\n[^\n]*\n(.*)$'
local RECORD_TASK = '^[^\n]*\n[^\n]*\n[^\n]*\n[^\n]*\n[^\n]*\n[^\n]*\n[^\n]*\n[^\n]*\n' ..
  '[^\n]*\n[^\n]*\n[^\n]*\n[^\n]*\n(.*)$'
-- exec, handoff, copies and the task id
local RECORD_EXEC_HANDOFF_COPIES_TASK = '^([^\n]*)\n([^\n]*)\n([^\n]*)\n[^\n]*\n[^\n]*\n' ..
  '[^\n]*\n[^\n]*\n[^\n]*\n[^\n]*\n[^\n]*\n[^\n]*\n[^\n]*\n(.*)$'
-- the fields from lease on, as the caller sends them (ARGV): the retries, third
local REST_RETRIES = '^[^\n]*\n[^\n]*\n([^\n]*)'

-- A new record: no handoff, no copies; at = now; the rest as the caller sent it.
local function new_record(exec_id, token, now, rest)
  return exec_id .. '\n\n\n' .. token .. '\n' .. now .. '\n' .. rest
end

-- A record naming only a holder's task id (retries 0): what a refusal names
-- when the holder is a send-time key, not a running execution.
local function holder_record(task_id)
  return '\n\n\n\n\n\n\n\n0\n\n\n\n' .. task_id
end

-- The record with ``copies`` set: a redelivered copy was seen.
local function with_copies(record, exec, handoff, copies)
  return exec .. '\n' .. handoff .. '\n1' .. string.sub(record, #exec + #handoff + #copies + 3)
end


-- The server clock of a TIME reply, in milliseconds.
local function clock_ms(t)
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The server clock of a TIME reply in microseconds, as digits: seconds and six places.
local function clock_us(t)
  local us = t[2]
  return t[1] .. string.sub('00000', #us) .. us
end

-- Tokens are digits: a shorter one is smaller, equal lengths compare as text.
local function below(a, b)
  return #a < #b or (#a == #b and a < b)
end

-- 'token', or one above 'other' when 'other' is not below it: where the two
-- meet, one above, never equal (two holders never share a token).
local function past(token, other)
  if other and not below(other, token) then
    return string.format('%.0f', tonumber(other) + 1)
  end
  return token
end

-- The token of a grant at the server clock 'now' (clock_us), and the key's
-- fencing counter set to it for 'fence_ms'. Tokens never go down, even when
-- the counter is gone (expired, evicted, a failover): the server clock is
-- their floor. One grant takes longer than a microsecond, so the counter
-- cannot run ahead of the clock for long, and a lost counter restarts above
-- every token already given. The counter guards against the clock stepping
-- back; it expires (by the server clock) fence_ms after the last grant or
-- renewal, so it guards a step back of up to that long. The clock is written
-- first and read back in one call: a counter at or above it (a grant in this
-- microsecond, a clock set back) is rare, and costs a second write.
local function grant_token(fence, now, fence_ms)
  local last = redis.call('SET', fence, now, 'PX', fence_ms, 'GET')
  local token = past(now, last)
  if token ~= now then
    redis.call('SET', fence, token, 'PX', fence_ms)
  end
  return token
end

-- singleton_rate: nil while the window of 'rate' (a sorted set of starts,
-- scored by the server clock in ms) has room for 'task_id' (its own retry is
-- the start it made already); otherwise {7, the start that made it full, ms
-- until the window admits another}.
local function rate_full(rate, task_id, allowed, window)
  local now_ms = clock_ms(redis.call('TIME'))
  redis.call('ZREMRANGEBYSCORE', rate, '-inf', now_ms - window)
  local count = redis.call('ZCARD', rate)
  if count >= allowed and not redis.call('ZSCORE', rate, task_id) then
    local oldest = redis.call('ZRANGE', rate, count - allowed, count - allowed, 'WITHSCORES')
    return {7, oldest[1], tonumber(oldest[2]) + window - now_ms}
  end
  return nil
end

-- Whether a request whose caller gave up waiting for its reply at 'deadline'
-- (server ms; '0': none) arrived later than that, by the clock 't' (a TIME
-- reply). Such a request (held up in a network path, resent by a kernel after
-- its caller's timeout) writes nothing: the script returns {8, the clock in
-- ms}. Checked where a script is about to write what its caller would hold
-- (a grant, a send-time key): a refusal writes nothing its caller needs.
local function too_late(deadline, t)
  local limit = tonumber(deadline)
  return limit > 0 and clock_ms(t) > limit
end

-- How long a grant lives until its holder confirms it (ms): the lease, but no
-- later than 'confirm_by' (server ms; '0': no bound): its request's deadline
-- and one more wait, time enough for a reply that reached its caller in time
-- to be followed by the confirmation. A holder that got the reply confirms at
-- once (renew.lua, sent without waiting), which gives it the whole lease; a
-- grant whose reply never reached its caller (a network path cut just after
-- the request went through) expires by itself then, holding the key for
-- nobody no longer than that.
local function grant_ttl(lease, confirm_by, t)
  local limit = tonumber(confirm_by)
  if limit > 0 then
    return math.max(1, math.min(tonumber(lease), limit - clock_ms(t)))
  end
  return lease
end
