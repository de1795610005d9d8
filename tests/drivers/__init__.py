"""Driver scripts run as subprocesses by kill tests (twophase.chaos.run_with_faults)."""
