"""twophase: exactly-once sinks for PySpark by two-phase commit."""
