"""Runnable examples: the classic end-to-end exactly-once pipelines, built on twophase.

Each module runs with ``python -m examples.<name> --help`` against real services
(Kafka, PostgreSQL, local files); docs/examples.md explains each one and its command.
"""
