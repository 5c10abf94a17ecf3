"""The Cortex gateway: OpenAI-compatible HTTP API in front of the fleet; jobs go out over Redis."""
