"""Helpers for testing and benchmarking dptrain itself (not needed to train)."""
