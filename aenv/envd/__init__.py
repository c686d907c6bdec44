"""envd: aenv's in-sandbox agent, speaking the E2B envd API on port 49983.

Runs inside every sandbox (started from the node's relocated interpreter
bundle) and serves the Connect services process.Process and
filesystem.Filesystem plus envd's HTTP routes (/files, /health, /init, /envs,
/metrics) to the E2B SDKs. Imports stay lean (trio, hypercorn, stdlib,
aenv.proto): start-up time under gVisor matters.
"""
