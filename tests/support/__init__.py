"""Helpers for tests and benchmarks: synthetic volumes and loopback range servers."""
