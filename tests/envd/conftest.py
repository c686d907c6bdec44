"""pytest fixtures for tests/envd (defined in envd_helpers)."""

from envd_helpers import api_stub, envd, home, test_user

__all__ = ["api_stub", "envd", "home", "test_user"]
