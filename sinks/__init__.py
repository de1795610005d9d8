"""Shipped sinks: files, Kafka, PostgreSQL."""
