"""The gateway's side of Redis pub/sub: one event router per process, its links, listeners and what an outage means."""
