"""Driver-side coordinator."""
