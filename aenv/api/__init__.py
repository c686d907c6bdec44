"""HTTP surface of a node: the E2B REST API and the sandbox traffic proxy."""
