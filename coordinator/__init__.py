"""The driver-side coordinator: pass it to ``foreachBatch`` and every batch is committed exactly once."""

from twophase.coordinator.coordinator import BatchProgress, Coordinator

__all__ = ["BatchProgress", "Coordinator"]
