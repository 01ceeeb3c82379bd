"""The `qmill` command: the one place that sees both the client and the server."""
