-- Shared by w1.lua / w2.lua: POST a fixed JSON body and print a JSON summary line
-- (the same bodies and summary for every server, so figures compare).
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"

function make_body(n, denom)
  local t = {}
  for i = 0, n - 1 do t[#t + 1] = string.format("%.6f", i / denom) end
  return '{"x": [' .. table.concat(t, ", ") .. ']}'
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests": %d, "duration_us": %d, "rps": %.2f, "lat_mean_us": %.1f, ' ..
    '"lat_p50_us": %d, "lat_p90_us": %d, "lat_p99_us": %d, "lat_max_us": %d, ' ..
    '"err_connect": %d, "err_read": %d, "err_write": %d, "err_status": %d, "err_timeout": %d}\n',
    summary.requests, summary.duration, summary.requests / (summary.duration / 1e6), latency.mean,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
    e.connect, e.read, e.write, e.status, e.timeout))
end
