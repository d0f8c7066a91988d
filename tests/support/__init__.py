"""Helpers shared by the test suites (independent oracles, process fixtures)."""
