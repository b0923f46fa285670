"""Frozen values with no I/O: snapshots of scrapes, GPU readings, engine dialects."""
