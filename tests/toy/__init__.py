"""A toy backend for the registry test (tests/test_backend_registry.py); not a real check."""
