#!lua
-- Pop up to ARGV[2] messages from a queue's priority lists and record each one as
-- unacknowledged, in kombu's own format, in the same atomic step (worker/broker.py).
-- KEYS: the priority lists in consuming order, then the unacked index and hash.
-- ARGV: the time to record (the client's: kombu's restore compares it with its own clock;
-- the end of the wait the script ran behind, worker/broker.py),
-- the most messages to pop. Returns {list, item, tag} triples; tag is '' for an item that
-- is not a kombu message (not recorded), and is the message's own delivery tag unless an
-- unacked record holds that one already: then a fresh one, so no message overwrites
-- another's record (a pushed message chooses its own tag). The record keeps the item's
-- bytes, own tag included: a restored message is checked again when popped again.
-- The shebang makes a server out of memory refuse the whole script instead of failing it
-- after a pop.
local index, unacked = KEYS[#KEYS - 1], KEYS[#KEYS]
local now, limit = ARGV[1], tonumber(ARGV[2])

local function delivery(item)
  local ok, payload = pcall(cjson.decode, item)
  if not ok or type(payload) ~= 'table' or type(payload.properties) ~= 'table' then return end
  local properties = payload.properties
  local info = properties.delivery_info
  if type(properties.delivery_tag) == 'string' and type(info) == 'table'
      and type(info.exchange) == 'string' and type(info.routing_key) == 'string' then
    return properties.delivery_tag, info.exchange, info.routing_key
  end
end

-- The tag itself when free, else TAG#SECONDS.MICROSECONDS.N: the server's clock makes the
-- first fresh one free but for the messages of this same pop, which N tells apart.
local function free(tag)
  if redis.call('HEXISTS', unacked, tag) == 0 then return tag end
  local time, n, fresh = redis.call('TIME'), 0, nil
  repeat
    n = n + 1
    fresh = tag .. '#' .. time[1] .. '.' .. time[2] .. '.' .. n
  until redis.call('HEXISTS', unacked, fresh) == 0
  return fresh
end

local popped = {}
for i = 1, #KEYS - 2 do
  local left = limit - #popped
  if left <= 0 then break end
  for _, item in ipairs(redis.call('RPOP', KEYS[i], left) or {}) do
    local tag, exchange, routing_key = delivery(item)
    if tag then
      tag = free(tag)
      redis.call('ZADD', index, now, tag)
      -- kombu's record, [payload, exchange, routing_key], around the payload's own bytes
      redis.call('HSET', unacked, tag,
                 '[' .. item .. ',' .. cjson.encode(exchange) .. ',' .. cjson.encode(routing_key) .. ']')
    end
    popped[#popped + 1] = {KEYS[i], item, tag or ''}
  end
end
return popped
