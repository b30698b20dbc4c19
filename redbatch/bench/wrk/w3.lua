-- W3 "variable-length text": the 64 bodies ({"input_ids": [...], "attention_mask": [...]},
-- 8 to 458 tokens) from the file $REDBATCH_W3_BODIES (one flat JSON object per line, as
-- the bench writes it), sent round-robin in request order: each body equally often, so
-- tokens/s = req/s x mean length.
package.path = debug.getinfo(1, "S").source:match("@?(.*/)") .. "?.lua;" .. package.path
require "common"

local f = assert(io.open(assert(os.getenv("REDBATCH_W3_BODIES"), "REDBATCH_W3_BODIES unset"), "r"))
local text = f:read("*a")
f:close()
local bodies = {}
for body in text:gmatch("{[^{}]*}") do bodies[#bodies + 1] = body end
assert(#bodies == 64, "W3 bodies: expected 64, found " .. #bodies)

local reqs, i = {}, 0
init = function(args)  -- after wrk has set the Host header: format the 64 requests once
  for k, b in ipairs(bodies) do reqs[k] = wrk.format(nil, nil, nil, b) end
end
request = function()
  i = i % #reqs + 1
  return reqs[i]
end
