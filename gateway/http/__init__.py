"""The HTTP API: the server, its middleware and errors, the routes."""
