"""The cluster: ownership of sandboxes across nodes (leases.py)."""
