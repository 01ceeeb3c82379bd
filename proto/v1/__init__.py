"""Generated stubs of proto/qmill/v1 (see proto/generate.py)."""
