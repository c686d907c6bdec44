"""The cluster: nodes that find each other by gossip, route calls to a sandbox's owner and place new sandboxes."""
