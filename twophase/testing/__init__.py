"""Conformance harness."""
