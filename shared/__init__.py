"""Code shared by the gateway and the node agents: settings, Redis keys, wire messages, errors."""

__version__ = "0.1.0"
WIRE_VERSION = 9  # 2: SamplingParams.grammar, kind "count"; 3: the start event, echo, prompt logprobs; 4: images;
# 5: events are msgspec Structs: unknown fields refused in every part, fields at their defaults left out of parts;
# 6: the job entry's `traceparent`; 7: the request's `prefix_marks` (cache-aware routing), then its `cache_salt`
# (sent only when set, `Wire.added_within_version`: with API keys and scope `key`, or a request's `cache_salt`;
# a node of 7 from before refuses those jobs, so upgrade nodes before gateways)
# 8: embedding and rerank jobs (`PoolingRequest`, the done event's `pooled`); SamplingParams.speculative,
# num_speculative_tokens; then the job entry's `key` (sent only for metered jobs: the node counts their tokens
# where they end; a node of 8 from before refuses them, so upgrade nodes before gateways)
# 9: the job entry's fields named as the glossary names them: `job_class` (was `priority`), `channel`
# (was `reply`), `streaming` (was `stream`), `api_key` (was `key`); a part of 8 refuses a part of 9's entries
