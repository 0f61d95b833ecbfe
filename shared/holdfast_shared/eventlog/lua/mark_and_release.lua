-- KEYS: events stream, archived watermark, claim. ARGV: archived seq (0: none), ttl ms.
-- Ends a copying pass: marks what it copied and gives the claim back.
-- (mark.lua comes first.)
local marked = 0
if ARGV[1] ~= '0' then marked = mark(KEYS[1], KEYS[2], ARGV[1], ARGV[2]) end
redis.call('DEL', KEYS[3])
return marked
