-- Start a campaign's jobs, those on its books only, atomically: a message may name any
-- campaign and job id, and a worker records nothing (no key, no field) for a job nobody
-- submitted. A job is on the books of a campaign fed through a window (its counts hash has a
-- window) while it is open; of any other campaign once it is in its submitted set. A job on
-- the books counts an attempt and is running. The attempts hash of a campaign not fed through
-- a window expires ARGV[1] seconds after its last start, so one whose jobs stopped coming
-- leaves no hash for ever (a counted campaign forgets a job's attempts as the job ends).
-- KEYS[1]: the campaign's attempts hash; KEYS[2]: its running set; KEYS[3]: its counts hash
-- (field window); KEYS[4]: its open set; KEYS[5]: its submitted set
-- ARGV[1]: seconds the attempts hash lasts after its last start; ARGV[2..]: job ids
-- Returns per job its attempt number (1 or more) if it is on the books, else, recording
-- nothing for it: 0 (renderfarm/progress.py's NOT_SUBMITTED) for a job of a campaign not fed
-- through a window that is not in its submitted set, -1 (NOT_OPEN) for a job of a counted
-- campaign that is not open (done, failed for good, or never admitted).
local counted = redis.call('HEXISTS', KEYS[3], 'window') == 1
local books, missing = KEYS[5], 0
if counted then
  books, missing = KEYS[4], -1
end
local attempts, started = {}, false
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('SISMEMBER', books, id) == 1 then
    attempts[#attempts + 1] = redis.call('HINCRBY', KEYS[1], id, 1)
    redis.call('SADD', KEYS[2], id)
    started = true
  else
    attempts[#attempts + 1] = missing
  end
end
if started and not counted then
  redis.call('EXPIRE', KEYS[1], ARGV[1])
end
return attempts
