"""The cluster: nodes that find each other by gossip (membership), route calls to a
sandbox's owner (router), place new sandboxes (placement) and hold each sandbox
by a fenced lease in the object store (leases)."""
