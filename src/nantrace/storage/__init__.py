"""Persistence: the SQLite run store and the incident bundles."""
