-- KEYS: claim, archived watermark, events stream. ARGV: claim ms, count.
-- Takes the task's copying claim and, if it got it, reads the watermark and the
-- first batch after it: one round trip where a copying pass starts.
if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then return false end
local watermark = tonumber(redis.call('GET', KEYS[2]) or '0')
return {watermark, redis.call('XRANGE', KEYS[3], (watermark + 1) .. '-0', '+', 'COUNT', ARGV[2])}
