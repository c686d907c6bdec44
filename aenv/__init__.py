"""aenv: self-hosted agent environments that speak the E2B API.

A node runs sandboxes (gVisor today, Firecracker later) from templates, serves
the E2B REST API and proxies the SDKs' data-plane traffic to each sandbox's
envd. The package layers, top to bottom: cli > api > node > runtimes|storage >
envd > kit > proto.
"""

__version__ = "0.1.0"
