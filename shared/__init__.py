"""Code shared by the gateway and the node agents: settings, Redis keys, wire messages, errors."""

__version__ = "0.1.0"
WIRE_VERSION = 11  # 2: SamplingParams.grammar, kind "count"; 3: the start event, echo, prompt logprobs; 4: images;
# 5: events are msgspec Structs: unknown fields refused in every part, fields at their defaults left out of parts;
# 6: the job entry's `traceparent`; 7: the request's `prefix_marks` (cache-aware routing), then its `cache_salt`
# (sent only when set, `Wire.added_within_version`: with API keys and scope `key`, or a request's `cache_salt`;
# a node of 7 from before refuses those jobs, so upgrade nodes before gateways)
# 8: embedding and rerank jobs (`PoolingRequest`, the done event's `pooled`); SamplingParams.speculative,
# num_speculative_tokens; then the job entry's `key` (sent only for metered jobs: the node counts their tokens
# where they end; a node of 8 from before refuses them, so upgrade nodes before gateways)
# 9: the job entry's fields named as the glossary names them: `job_class` (was `priority`), `channel`
# (was `reply`), `streaming` (was `stream`), `api_key` (was `key`); a part of 8 refuses a part of 9's entries;
# then, additive (defaults, so either side may be older), the heartbeat's KV tier counters
# (`KVCacheStats.host_*`, `disk_*`, bytes moved) and the `prefix-tiers` hash beside a node's prefixes
# (`Keys.prefix_tiers`)
# 10: the `stored` event: an event larger than the node's `max_event_bytes` waits in `Keys.result` and
# travels as a pointer to it (pub/sub never carries a message near Redis's output buffer limit)
# 11: the job entry's `tenant` (its caller, whose waiting room it went through: a node takes a caller
# with nothing running on it beyond its slots while others' jobs wait); a part of 10 refuses its entries
