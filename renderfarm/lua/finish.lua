-- Mark a campaign's jobs done and add each newly done job's device-seconds to the campaign's
-- total, atomically: a job finished twice (a redelivery after its result was stored) counts
-- once.
-- KEYS[1]: the campaign's done set; KEYS[2]: its times hash (field device_seconds)
-- ARGV: job id, device-seconds, job id, device-seconds, ...
-- Returns the device-seconds added, as a string (Lua numbers would be cut to integers).
local added = 0
for i = 1, #ARGV, 2 do
  if redis.call('SADD', KEYS[1], ARGV[i]) == 1 then
    added = added + tonumber(ARGV[i + 1])
  end
end
if added > 0 then
  redis.call('HINCRBYFLOAT', KEYS[2], 'device_seconds', added)
end
return tostring(added)
