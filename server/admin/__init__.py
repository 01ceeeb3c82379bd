"""The Admin service: server-wide information for operators."""
