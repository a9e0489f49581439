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

