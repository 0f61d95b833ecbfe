-- Records the watermark; lets the stream expire only when nothing is unarchived.
-- The first part of mark_archived and mark_and_release (scripts.py joins them).
local function mark(events, archived, seq, ttl)
  redis.call('SET', archived, seq)
  local last = redis.call('XREVRANGE', events, '+', '-', 'COUNT', 1)
  if #last == 0 then return 0 end
  local id = last[1][1]
  if tonumber(string.sub(id, 1, string.find(id, '-', 1, true) - 1)) == tonumber(seq) then
    redis.call('PEXPIRE', events, ttl)
    redis.call('PEXPIRE', archived, ttl)
    return 1
  end
  return 0
end
