"""Every tunable default of redbatch, in one place.

The config dataclasses (``config.py``), the batching policy and ``@batch``
(``worker/``), the producer ``Client``, the command line and the bulk jobs read their
defaults from here (the config file of ``redbatch up -c`` through the dataclasses);
``docs/configuration.md`` lists them (a test keeps the two equal).  One default shared
by two settings has one name; settings whose defaults differ have a name each
(``GATEWAY_MAX_TIMEOUT_S``, ``CLIENT_MAX_TIMEOUT_S``).

What is not tunable stays where it belongs: the wire format's key templates, fields,
TTLs and hard limits in ``protocol.py``, an algorithm's internal constants in its
module.  It imports nothing of redbatch, so that any module (``errors.py`` too) may read
it.
"""

from __future__ import annotations

from typing import Final

# --- Redis (RedisSettings, redis_conn) -------------------------------------------------
REDIS_URL: Final = "redis://127.0.0.1:6379/0"  # where Redis is when REDIS_URL is unset
SOCKET_TIMEOUT_S: Final = 10.0  # Redis socket timeout: > 1 s above every blocking pop's
CONNECT_TIMEOUT_S: Final = 2.0  # Redis connect timeout
PROBE_TIMEOUT_S: Final = 0.8  # a readiness probe answers 503 when Redis takes longer
GENERATE_MAX_BYTES: Final = 64 << 20  # v2 generate: the chunks of one JSON answer, at most
REDIS_MAX_CONNECTIONS: Final = 32  # connections in one asyncio client's pool
MAX_LISTENERS: Final = 1024  # room in a client's pool for its reply listeners' connections

# --- the gateway (GatewayConfig) and the producer Client --------------------------------
HOST: Final = "127.0.0.1"  # the gateway's bind address
PORT: Final = 8000  # the gateway's port
DEFAULT_TIMEOUT_S: Final = 30.0  # deadline of a request that sets none (gateway, Client)
GATEWAY_MAX_TIMEOUT_S: Final = 60.0  # longest deadline an HTTP caller may ask for
CLIENT_MAX_TIMEOUT_S: Final = 600.0  # a Client's: the wire's limit, protocol.MAX_TIMEOUT_S
MAX_BODY_BYTES: Final = 1024 * 1024  # request body limit (413 above)
MAX_QUEUE_LEN: Final = 10_000  # cap of each model's queue (gateway, Client; 503 above)
MAX_WAITERS: Final = 10_000  # requests one process may have waiting (gateway, Client)
META_REFRESH_S: Final = 2.0  # how long the gateway caches a model's metadata
BLOCK_TIMEOUT_S: Final = 1.0  # blocking pop timeout of reply listeners and workers
LISTENER_IDLE_S: Final = 30.0  # a model's reply listener stops once idle this long
KNOWN_GRACE_S: Final = 60.0  # a model known this recently is not "unknown" (503, not 404)
API_KEY: Final = ""  # the gateway's API key; empty: no auth
MAX_HEADER_BYTES: Final = 64 * 1024  # request line and headers limit (431 above)
HEADER_TIMEOUT_S: Final = 10.0  # a connection whose request head takes longer is closed
BODY_TIMEOUT_S: Final = 30.0  # a connection whose body takes longer is closed
SEND_TIMEOUT_S: Final = 30.0  # a client that reads nothing of its answer this long: closed
# (above the idle timeouts of the clients and proxies in front: httpx 5 s, nginx's
# upstream 60 s, AWS ALB 60 s; else one may send a request as the gateway closes)
KEEP_ALIVE_S: Final = 75.0  # an idle keep-alive connection is closed after this long
GATEWAY_MAX_CONNECTIONS: Final = 1024  # open connections per gateway process
GATEWAY_PROCESSES: Final = 2  # gateway processes sharing the port (scripts/layout)
PACK_ROWS: Final = 32  # a Client's most rows in one multi-row request (1: never pack)
LIVE_REFRESH_S: Final = 1.0  # a process reads who is live at most this often per model
MISS_REFRESH_S: Final = 0.25  # ...and a model unknown or with no live worker, this often
RETRY_AFTER_S: Final = 1.0  # what a 503 advises when nothing better is known (Retry-After)
ENQUEUE_DRAIN_S: Final = 5.0  # a closing Client waits this long for pushes in flight
WAIT_REPLICAS: Final = 0  # replicas that must acknowledge an enqueue (Redis WAIT); 0: off
WAIT_TIMEOUT_MS: Final = 100  # how long that WAIT may block (cut to the request's deadline)
WAIT_TIMEOUT_MAX_MS: Final = 10_000  # the longest wait_timeout_ms accepted
WAIT_WARN_EVERY_S: Final = 10.0  # an unacknowledged enqueue is logged at most this often
DRAIN_SETTLE_S: Final = LIVE_REFRESH_S + 1.0  # a draining version's workers serve this long
# at least after they see the drain (every producer has seen it by then), then stop once
# its queue and their in-flight lists are empty
DRAINED_EXIT_CODE: Final = 3  # a worker process that stopped after draining: not restarted
SCALE_DRAIN_S: Final = 60.0  # redbatch_workers_needed plans to drain a backlog within this
GENERATE_MAX_BATCH_SIZE: Final = 64  # the generate demo's streams in one running batch
HANDOFF_WAIT_S: Final = 1.0  # a pipeline stage's mover blocks this long for hand-offs
BENCH_LIVE_TIMEOUT_S: Final = 60.0  # a bench waits this long for its workers to be live

# --- workers (WorkerConfig, Pool) ---------------------------------------------------------
HEARTBEAT_INTERVAL_S: Final = 1.0  # worker heartbeat (lease renewal) period
LEASE_TTL_S: Final = 10.0  # past its lease, a worker's in-flight requests are reaped
REPLICAS: Final = 1  # worker processes
DEVICE: Final = "auto"  # auto, cpu, cuda or cuda:N[,cuda:M]
THREADS: Final = 1  # CPU threads per worker process
MAX_ATTEMPTS: Final = 3  # worker crashes a request may cause before it is dead-lettered
GRACE_S: Final = 30.0  # on SIGTERM, a worker's time to finish its batch
POOL_STOP_MARGIN_S: Final = 8.0  # a pool SIGKILLs replicas alive grace_s + this after SIGTERM
# (a replica past its grace: 3 s for its heartbeat and duty, 3 s to leave, with Redis stalled)
POOL_TICK_S: Final = 0.5  # a pool's supervisor looks at its replicas at least this often
GATEWAY_PROCS_TICK_S: Final = 0.2  # a multi-process gateway looks at its processes this often
METRICS_PORT: Final = 0  # Prometheus /metrics of replica i on METRICS_PORT + i; 0: off
DEAD_LETTER_TTL_S: Final = 24 * 3600  # a model's dead letters expire this long after the last
DEAD_LETTER_MAX_BYTES: Final = 4096  # a dead letter keeps this many first bytes of its entry
MAX_FAILED_STARTS: Final = 5  # failed starts of a replica that never served stop the pool
SERVED_WINDOW_S: Final = 10.0  # a worker's served_per_s is measured over about this long

# --- batching (BatchPolicy, @batch, Model) ------------------------------------------------
MAX_BATCH_SIZE: Final = 32  # most requests in one forward pass
BATCH_WAIT_TIMEOUT_S: Final = 0.005  # the batch window
STRIDE_S: Final = 0.0  # least time between two batch pops of one worker; 0: continuous
ALLOW_SMALL_BATCH: Final = True  # a window counts from the oldest request's enqueue
ADAPTIVE: Final = True  # a lone request skips the window while load is light
MAX_CONCURRENT_BATCHES: Final = 1  # batches between claim and publish per worker
QUIET_S: Final[float | None] = None  # gap that closes a window early; None: a quarter of it
MAX_BATCH_COST: Final[float | None] = None  # most total cost in one pass; None: no cost
AUTO_BATCH: Final = False  # pass sizes by measurement (max_batch_size a cap); off: the cap
HOLD_BUCKETS: Final = True  # with auto_batch: an under-filled length bucket may wait a batch
PAD_TO_LONGEST: Final = False  # a variable-length pass padded to its longest item, not its bucket
OVERSIZE: Final = "alone"  # an item costlier than max_batch_cost: alone, or refuse (422)
PRIORITY_LEVELS: Final = 1  # a model's priority levels (1..L; 1: one queue, no priorities)
DEFAULT_PRIORITY: Final = 1  # the level of a request that gives none (or 0)
PRIORITY_SHARE: Final = 0.1  # least share of claimed entries kept for the less urgent levels
INPUT_NAME: Final = "inputs"  # a model's input field in JSON bodies
OUTPUT_NAME: Final = "outputs"  # a model's output field in JSON answers

# --- logs and the command line -------------------------------------------------------------
LOG_LEVEL: Final = "INFO"  # log level
LOG_FORMAT: Final = "text"  # text, or json: one JSON object per line
STATUS_INTERVAL_S: Final = 2.0  # `redbatch status`: sampling interval of items/s

# --- bulk jobs (redbatch.jobs: BulkOptions, submit_bulk, `redbatch jobs`) ----------------
BULK_QUEUE: Final = "redbatch-bulk"  # the RQ queue of bulk jobs
JOB_CHUNK_SIZE: Final = 64  # items per submit_many round trip
JOB_MAX_WAIT_S: Final = 30.0  # longest wait for the model's queue to drain before a chunk
JOB_ITEM_TIMEOUT_S: Final = 60.0  # deadline of each item, counted from its push
JOB_MAX_INFLIGHT_CHUNKS: Final = 4  # chunks awaiting replies at a time
JOB_WAIT_WORKERS_S: Final = 10.0  # how long a job waits for a live worker before failing
JOB_MAX_ERRORS: Final = 5  # item error messages kept in job.meta
JOB_RESULT_TTL_S: Final = 24 * 3600  # a finished job and its outputs stay this long
JOB_FAILURE_TTL_S: Final = 7 * 24 * 3600  # a failed job stays in the failed-job registry
JOB_TIMEOUT_S: Final = 6 * 3600  # RQ kills a job that runs longer
JOB_RETRIES: Final = 2  # immediate re-runs of a failed job
JOB_POLL_S: Final = 0.5  # how often `redbatch jobs --wait/--watch` read the job
