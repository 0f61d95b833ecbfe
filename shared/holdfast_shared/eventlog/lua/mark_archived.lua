-- KEYS: events stream, archived watermark. ARGV: archived seq, ttl ms.
-- (mark.lua comes first.)
return mark(KEYS[1], KEYS[2], ARGV[1], ARGV[2])
