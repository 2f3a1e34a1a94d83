"""Helpers for tests that start real clusters on 127.0.0.1."""
