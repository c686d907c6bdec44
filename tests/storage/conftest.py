"""Storage tests use the shared `bundle` and `busybox_lower` fixtures of tests/conftest.py."""
