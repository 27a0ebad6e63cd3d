"""Shared test support: small models, the real server in a thread or a process."""
