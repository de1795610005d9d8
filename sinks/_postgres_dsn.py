"""Driver: where PostgresSink's connection-string parser was before the sink became a package
(now :mod:`twophase.sinks.postgres.dsn`).  Kept for code that still imports it here: older
revisions of the sink, which tests load from git (tests/harness_reach.py ``load_old_sink``).
"""

from twophase.sinks.postgres.dsn import jdbc_to_libpq, parse

__all__ = ["jdbc_to_libpq", "parse"]
