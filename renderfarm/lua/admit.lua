#!lua
-- Record a campaign's jobs as open (queued or running) and push their messages, in one
-- atomic step: a feeder that dies or loses Redis has sent a chunk whole or not at all, so
-- every open job has its message (a later run leaves open jobs to the workers and sends the
-- rest). Jobs sent again start afresh: no stale failure, a full set of attempts. The shebang
-- makes a server out of memory refuse the whole script instead of failing it halfway.
-- KEYS[1]: the campaign's open set; KEYS[2]: its counts hash (field submitted); KEYS[3]: its
-- failed hash; KEYS[4]: its attempts hash; KEYS[5]: its times hash (field first_submitted);
-- KEYS[6]: the set of queue names; KEYS[7..]: the lists the messages go to
-- ARGV: the time, the number of job ids, the job ids, the number of queue names, the queue
-- names, then for each list of KEYS[7..] in order the number of its messages and the messages
-- (each list gets them as one LPUSH of them in that order would).
local function each(command, key, from, to)
  for i = from, to, 1000 do  -- slices: unpack cannot take every argument at once
    redis.call(command, key, unpack(ARGV, i, math.min(i + 999, to)))
  end
end

local now, jobs = ARGV[1], tonumber(ARGV[2])
local ids = 3
local queues = ids + jobs + 1
each('HDEL', KEYS[3], ids, ids + jobs - 1)
each('HDEL', KEYS[4], ids, ids + jobs - 1)
each('SADD', KEYS[1], ids, ids + jobs - 1)
redis.call('HINCRBY', KEYS[2], 'submitted', jobs)
redis.call('HSETNX', KEYS[5], 'first_submitted', now)
each('SADD', KEYS[6], queues, queues + tonumber(ARGV[queues - 1]) - 1)
local at = queues + tonumber(ARGV[queues - 1])
for k = 7, #KEYS do
  local count = tonumber(ARGV[at])
  each('LPUSH', KEYS[k], at + 1, at + count)
  at = at + count + 1
end
return jobs
