-- KEYS: events stream, archived watermark, the task's turn lock, its turn epoch.
-- ARGV: the task's name (the events' ``task_id``), turn_id ('' = null), floor
--       seq ('' = unknown), floor ts, release ('1' = release the turn lock if
--       turn_id holds it), epoch ('' = unfenced), the append's token ('' =
--       none; kept in the first entry's field ``a``), retry ('1' = this call
--       may have landed before: if an entry among the last (its size + 64) has
--       the token, answer as that append did instead of appending again), then
--       (type, body) pairs.
-- Returns {first_seq, ts_1, ...}, {-1} when the stream is gone and the caller
-- must supply the floor from PostgreSQL, or {-2} when another worker took the
-- turn over (fenced).
-- The envelope of each event (task_id, turn_id, seq, timestamp, then the body's
-- fields) is built here, where seq and timestamp are assigned: events.envelope_json
-- is its Python twin (tests/shared/test_eventlog.py holds them equal).
if ARGV[6] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[6] then return {-2} end
if ARGV[8] == '1' and ARGV[7] ~= '' then
  -- The landed append's first entry lies its own size back, behind what was
  -- appended since (a chaos run on a cluster met a 164-event batch twice when
  -- this looked only 64 back).
  local n = (#ARGV - 8) / 2
  local recent = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', n + 64)
  for _, entry in ipairs(recent) do
    local f = entry[2]
    for i = 1, #f, 2 do
      if f[i] == 'a' and f[i + 1] == ARGV[7] then
        local landed = redis.call('XRANGE', KEYS[1], entry[1], '+', 'COUNT', n)
        local out = {tonumber(string.sub(entry[1], 1, string.find(entry[1], '-', 1, true) - 1))}
        for _, e in ipairs(landed) do
          for j = 1, #e[2], 2 do
            if e[2][j] == 'ts' then out[#out + 1] = tonumber(e[2][j + 1]) end
          end
        end
        return out
      end
    end
  end
end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local seq, ts
if #last == 0 then
  if ARGV[3] == '' then return {-1} end
  seq = tonumber(ARGV[3]); ts = tonumber(ARGV[4])
else
  local id = last[1][1]
  seq = tonumber(string.sub(id, 1, string.find(id, '-', 1, true) - 1))
  local fields = last[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == 'ts' then ts = tonumber(fields[i + 1]) end
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local turn = 'null'
if ARGV[2] ~= '' then turn = '"' .. ARGV[2] .. '"' end
local head = '{"task_id":"' .. ARGV[1] .. '","turn_id":' .. turn .. ',"seq":'
local out = {seq + 1}
for i = 9, #ARGV, 2 do
  seq = seq + 1
  if now > ts then ts = now else ts = ts + 1 end
  local data = head .. string.format('%d', seq) .. ',"timestamp":' .. string.format('%d', ts)
    .. ',' .. string.sub(ARGV[i + 1], 2)
  if i == 9 and ARGV[7] ~= '' then
    redis.call('XADD', KEYS[1], string.format('%d', seq) .. '-0', 't', ARGV[i], 'ts',
      string.format('%d', ts), 'd', data, 'a', ARGV[7])
  else
    redis.call('XADD', KEYS[1], string.format('%d', seq) .. '-0', 't', ARGV[i], 'ts',
      string.format('%d', ts), 'd', data)
  end
  out[#out + 1] = ts
end
redis.call('PERSIST', KEYS[1])
redis.call('PERSIST', KEYS[2])
if ARGV[5] == '1' and redis.call('GET', KEYS[3]) == ARGV[2] then
  redis.call('DEL', KEYS[3])
end
return out
