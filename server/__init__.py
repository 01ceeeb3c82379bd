"""qmill.server."""
