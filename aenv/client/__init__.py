"""The `aenv` CLI's client side: credentials, the REST client and exec sessions.

Nothing here runs a node; it talks to one over HTTP (`rest`), over the exec
WebSocket (`session`, docs/exec-protocol.md) and drives the local terminal
(`terminal`). Errors are `errors.CliError`s that carry the exit code the CLI
documents (docs/cli.md).
"""
