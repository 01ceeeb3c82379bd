"""Batch jobs: a SQLite store, a background runner, the Jobs servicer."""
