"""Membership and signals: everything that learns about replicas from the outside world (all I/O lives here)."""
