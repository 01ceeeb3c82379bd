"""qmill.client."""
