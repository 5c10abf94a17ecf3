"""Wire types of the APIs the gateway speaks."""
