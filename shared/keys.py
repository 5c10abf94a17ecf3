"""Every Redis key and channel name Cortex uses, built in one place.

`docs/redis.md` lists them with what `redis-cli` shows for each. The prefix is configurable
(`CORTEX_KEY_PREFIX`, default ``cortex:``) so several fleets can share one Redis.

On a Redis Cluster (`cluster`) each key carries a hash tag, the part in braces, so that the keys
one command, Lua script or read touches share a hash slot: a model's job streams (`{model}`: one
script reads them all), a job's events and log (`{job}`), and one tag per concern for the keys its
scripts touch together (`{fleet}`, `{responses}`, `{files}`, `{batches}`, `{apikeys}`). Job
streams and events, where the traffic is, spread over the shards by model and by job. On one Redis
the names stay as they always were (no braces), so an upgrade keeps every stored key.
"""

from dataclasses import dataclass

CONSUMER_GROUP = "agents"

# the hash tags of the keys grouped by concern (on a cluster); a model's and a job's are their names
FLEET, RESPONSES, FILES, BATCHES, API_KEYS = "fleet", "responses", "files", "batches", "apikeys"


@dataclass(frozen=True)
class Keys:
    prefix: str = "cortex:"
    cluster: bool = False  # hash tags in the names (a Redis Cluster)

    def _in(self, tag: str, name: str) -> str:
        """`name` after the prefix, with `tag` as its hash tag on a cluster (``{fleet}:nodes``)."""
        return f"{self.prefix}{{{tag}}}:{name}" if self.cluster else f"{self.prefix}{name}"

    def _tagged(self, kind: str, tag: str) -> str:
        """``{kind}:{tag}``, the tag in braces on a cluster (``jobs:{m}``, ``events:{job}``)."""
        return f"{self.prefix}{kind}:{{{tag}}}" if self.cluster else f"{self.prefix}{kind}:{tag}"

    def jobs(self, model: str, job_class: str = "interactive", band: str = "normal") -> str:
        """Stream of queued jobs for one model, one priority class and one band (consumer group
        ``agents``): ``jobs:{model}`` is interactive/normal, the others add ``:{class}`` and, for
        the high and low bands, ``:{band}`` (``jobs:M:batch``, ``jobs:M:interactive:high``).
        `shared.queues.streams` lists them most urgent first."""
        return self._tagged("jobs", model) + self.stream_suffix(job_class, band)

    @staticmethod
    def stream_suffix(job_class: str, band: str) -> str:
        """What a class and band add to a model's stream name (``:batch:high``; '' for interactive/normal)."""
        suffix = "" if (job_class, band) == ("interactive", "normal") else f":{job_class}"
        return suffix + ("" if band == "normal" else f":{band}")

    def all_jobs(self) -> str:
        """The SCAN pattern matching every job stream of every model."""
        return f"{self.prefix}jobs:*"

    def node_jobs(
        self, model: str, node: str, job_class: str = "interactive", band: str = "normal"
    ) -> str:
        """Stream (group ``agents``): jobs the gateway routed to `node` (its cache holds their prefix,
        it ran their session's last turn, or it was the least busy; ``jobs:{model}[:{class}][:{band}]:@{node}``); only
        that node reads it, before the shared stream of the same class and band. The janitor moves
        what waits there too long, or whose node is gone, to `moved_jobs`."""
        return f"{self.jobs(model, job_class, band)}:@{node}"

    def moved_jobs(self, model: str, job_class: str = "interactive", band: str = "normal") -> str:
        """Stream (group ``agents``): jobs that left a node's own stream (`node_jobs`) unserved, each
        under its first entry id; every node reads it beside the shared stream, oldest first."""
        return f"{self.jobs(model, job_class, band)}:moved"

    @staticmethod
    def moved_of(node_stream: str) -> str:
        """The moved stream of a node's own stream (`node_jobs` → `moved_jobs` of its model, class and
        band), whatever the prefix or hash tags."""
        return node_stream.rsplit(":@", 1)[0] + ":moved"

    def all_waiting(self) -> str:
        """The SCAN pattern matching every waiting room and list of rooms of every model."""
        return f"{self.prefix}waiting:*"

    def waiting_keys(self, model: str, job_class: str = "interactive", band: str = "normal") -> str:
        """List: the waiting rooms (`waiting_room`) of one model, class and band that hold jobs, by
        key name, in the order nodes take from them (one job from the first, which goes to the back:
        round-robin, `shared.queues`); a room is on it exactly while it holds jobs
        (``waiting:{model}[:{class}][:{band}]``)."""
        return self._tagged("waiting", model) + self.stream_suffix(job_class, band)

    def waiting_room(
        self, model: str, tenant: str, job_class: str = "interactive", band: str = "normal"
    ) -> str:
        """Stream (no group): one caller's (an API key's, `admin`'s or `anonymous`'s) jobs for the
        shared stream of a model, class and band that arrived while that stream already had a job
        nobody had read, oldest first (``waiting:{model}[:{class}][:{band}]:~{tenant}``); a node
        moves each onto the shared stream as it reads it. Deleted once empty."""
        return f"{self.waiting_keys(model, job_class, band)}:~{tenant}"

    @staticmethod
    def shared_of(room: str) -> str:
        """The shared stream a waiting room's jobs are for (`waiting_room` → `jobs` of its model,
        class and band), whatever the prefix or hash tags (a prefix holding ``waiting:`` aside)."""
        return room.rsplit(":~", 1)[0].replace("waiting:", "jobs:", 1)

    def prefixes(self, model: str, node: str) -> str:
        """Hash with TTL (the node's heartbeat TTL, renewed by its heartbeats): conversation prefixes
        whose KV `node`'s cache holds for `model`, as the gateway names them (`shared.prefix_marks`)
        -> the tokens they span. Entries leave as the engine evicts their blocks; bounded by the cache."""
        return f"{self.prefix}prefixes:{model}:@{node}"

    def prefix_tiers(self, model: str, node: str) -> str:
        """Hash with the TTL of `prefixes`: the marks of `prefixes` whose blocks the node keeps only
        below its device, in host memory or on disk (node_agent/engine/kv_tiers.py) -> `host` or
        `disk`; a mark absent here is on the device. Written and expired with `prefixes`."""
        return f"{self.prefix}prefix-tiers:{model}:@{node}"

    def prefix_index(self, model: str) -> str:
        """Hash with TTL (the nodes' heartbeat TTL, renewed by their heartbeats): `{mark}@{node}` ->
        tokens, for every node's cache of `model` (what `prefixes` holds, for all nodes at once):
        routing reads a job's marks on every candidate node in one HMGET."""
        return self._tagged("prefixes", model)

    def session(self, model: str, session: str) -> str:
        """String with TTL (`session_ttl_s`): the node that ran the last turn of a session (a hash of
        the request's `prompt_cache_key`, `user`, `metadata.user_id` or `x-cortex-session`)."""
        return f"{self.prefix}session:{model}:{session}"

    def routing(self, model: str) -> str:
        """Hash: counters of how the gateways routed `model`'s jobs: ``cache``, ``session`` (to a
        node), ``shared`` (no node held anything), ``full`` (a node held it but had no room),
        ``moved`` (left a node's own stream unserved)."""
        return f"{self.prefix}routing:{model}"

    def events(self, job: str) -> str:
        """Pub/sub channel carrying one job's token events."""
        return self._tagged("events", job)

    def event_log(self, job: str) -> str:
        """Stream: one job's events kept for resuming (`shared.event_log`): the gateway's record of
        the request first, then one entry per engine step. Capped; it expires `stream_retention_s`
        after the job ends."""
        return self._tagged("eventlog", job)

    def result(self, job: str) -> str:
        """Hash with TTL (`stream_retention_s`): a job's events too large for pub/sub (over the node's
        `max_event_bytes`: embeddings, rerank scores, prompt logprobs, long outputs), each packed
        under the field its `stored` event names (`shared.wire.StoredEvent`). The gateway that reads
        a job nobody can resume deletes it; else it expires."""
        return self._tagged("result", job)

    def detached(self, job: str) -> str:
        """String with PX: the token of the last client that stopped reading the job; whoever
        wrote it cancels the job after `disconnect_grace_s` if it is still the last and nobody reads."""
        return self._tagged("detached", job)

    def metered(self, job: str) -> str:
        """String with TTL: set once a resumable job's tokens were counted against its key (so a
        resumed reader that sees the end too does not count them again)."""
        return self._in(API_KEYS, f"metered:{job}")

    def cancel(self) -> str:
        """Pub/sub channel: a message is the id of a job to cancel; every node listens."""
        return f"{self.prefix}cancel"

    def newcomers(self, model: str) -> str:
        """Pub/sub channel: a message (the model's name) says a caller's first job has just joined
        one of `model`'s waiting rooms (shared/queues.py); the nodes serving `model` listen."""
        return f"{self.prefix}newcomers:{model}"

    def node(self, node: str) -> str:
        """Hash with TTL: one node's heartbeat."""
        return self._in(FLEET, f"node:{node}")

    def nodes(self) -> str:
        """Sorted set: node name -> last heartbeat (ms since the epoch)."""
        return self._in(FLEET, "nodes")

    def host_nodes(self, host: str) -> str:
        """Sorted set with TTL (the heartbeat TTL, renewed by each beat): the node agents running on
        `host` (its hostname) -> their last beat (ms). Agents on one host split its cores between
        them (node_agent/host_share.py)."""
        return self._in(FLEET, f"host:{host}")

    def fleet_changes(self) -> str:
        """Stream (capped): what each node's heartbeat changed, in order: `node`, `started_ms`, `seq`
        (the node's count of changed heartbeats) and the fields of `node` that changed. Gateways
        keep their fleet view current from it (shared/fleet_view.py)."""
        return self._in(FLEET, "fleet:changes")

    def started(self, node: str) -> str:
        """Set: streaming jobs on `node` that have sent a token (a job leaves it when it ends). When
        the node dies the janitor fails these with `node_lost` and puts the others back."""
        return self._in(FLEET, f"started:{node}")

    def cmd(self, node: str) -> str:
        """Stream of lifecycle commands for one node."""
        return self._in(FLEET, f"cmd:{node}")

    def catalog(self) -> str:
        """Hash: model id -> profile (JSON)."""
        return self._in(FLEET, "catalog")

    def placement_lock(self, model: str) -> str:
        """String with PX: held by the gateway replica placing `model`."""
        return self._in(FLEET, f"lock:placement:{model}")

    def model_files(self, node: str) -> str:
        """Hash with TTL (the node's heartbeat TTL, renewed by its heartbeats): the model folders whose
        files `node` holds whole and serves to peers (`shared.model_store`) -> their manifest (JSON:
        source, commit, each file's name, size and sha256 or git blob id)."""
        return self._in(FLEET, f"modelfiles:{node}")

    def pull_lock(self, folder: str) -> str:
        """String with PX: held by the node pulling a model folder from the hub, so that other nodes
        wait for it and copy from it rather than pull the same files from the hub too."""
        return self._in(FLEET, f"lock:pull:{folder}")

    def pins(self) -> str:
        """Hash: model id -> "1" (pinned) / "0" (unpinned), set at run time over the catalogue's `pin`."""
        return self._in(FLEET, "pins")

    def janitor_lock(self) -> str:
        """String with PX: held by the gateway replica running the fleet janitor this round."""
        return self._in(FLEET, "lock:janitor")

    def response(self, response_id: str) -> str:
        """String with TTL (`responses_ttl_s`): a stored `/v1/responses` response and the
        conversation it ends (JSON), for `GET` and `previous_response_id`."""
        return self._in(RESPONSES, f"response:{response_id}")

    def background_responses(self) -> str:
        """Sorted set: ids of `background` responses not yet stored as finished -> submitted (ms);
        the janitor stores each once its job ends."""
        return self._in(RESPONSES, "responses:background")

    # ---- files and batches (`/v1/files`, `/v1/batches`, the arq batch worker) ----------------

    def file(self, file_id: str) -> str:
        """Hash: one uploaded or generated file: its metadata fields plus ``content`` (bytes)."""
        return self._in(FILES, f"file:{file_id}")

    def files(self) -> str:
        """Sorted set: file id -> created_at (unix seconds), for listing."""
        return self._in(FILES, "files")

    def files_bytes(self) -> str:
        """String: the bytes of every file kept, against `files_max_total_bytes`."""
        return self._in(FILES, "files:bytes")

    def batch(self, batch_id: str) -> str:
        """Hash: one batch object, one JSON value per OpenAI field (``status``, ``request_counts`` ...)."""
        return self._in(BATCHES, f"batch:{batch_id}")

    def batches(self) -> str:
        """Sorted set: batch id -> created_at (unix ms), for listing newest first with paging."""
        return self._in(BATCHES, "batches")

    def batches_active(self) -> str:
        """Set: ids of batches not yet completed, failed, expired or cancelled (workers resume these)."""
        return self._in(BATCHES, "batches:active")

    def batch_lines(self, batch_id: str, what: str) -> str:
        """Hashes of one running batch, keyed by input line number: ``out`` (output line JSON),
        ``err`` (error line JSON), ``inflight`` ("job entry-id stream" of the line's current
        job), ``tries`` (jobs submitted for the line). Deleted once the output files exist."""
        return self._in(BATCHES, f"batch:{batch_id}:{what}")

    def batch_lease(self, batch_id: str) -> str:
        """String with PX: the batch worker running the batch renews it; it expires if that worker dies."""
        return self._in(BATCHES, f"batch:{batch_id}:lease")

    def arq_queue(self) -> str:
        """arq's queue (sorted set) of batch-worker tasks. arq keeps its own keys beside it
        (``arq:job:*``, ``arq:in-progress:*``, ``arq:result:*``, ``arq:retry:*``, ``arq:cron:*``) and
        its health key ``{queue}:health-check``."""
        return f"{self.prefix}arq:queue"

    # ---- API keys and their limits (`cortex keys`, `/admin/keys`, every /v1 request) --------

    def api_key(self, name: str) -> str:
        """Hash: one API key by name: its metadata (``hash`` is the SHA-256 of the secret, never the
        secret) and its usage counters (``requests``, ``prompt_tokens``, ``completion_tokens``, ``rejections``)."""
        return self._in(API_KEYS, f"apikey:{name}")

    def api_keys(self) -> str:
        """Hash: SHA-256 of a secret -> key name; how a request's key is found (and whether any key exists)."""
        return self._in(API_KEYS, "apikeys")

    def rate_window(self, name: str, what: str) -> str:
        """Sorted set, PX 60 s: one key's last minute, ``requests`` (one member per admitted request) or
        ``tokens`` (one member per finished job, ``{job}:{tokens}``), scored by Redis time in ms."""
        return self._in(API_KEYS, f"ratelimit:{name}:{what}")

    def daily_tokens(self, name: str, day: str) -> str:
        """String, TTL 2 days: tokens (prompt + completion) one key used on one UTC day (``YYYY-MM-DD``)."""
        return self._in(API_KEYS, f"usage:{name}:{day}")
