"""Scripted stand-ins for what cannot run in the default suite (no root, no runsc).

Each implements the same Protocol as the real driver and follows its
observable behaviour, on trio's clock: `runtime.FakeRuntime` (runsc, checked
against `GVisorRuntime` by tests/runtimes/test_runtime_conformance.py),
`host.FakeNetwork` (network slots), `host.FakeRoots` (writable roots as plain
directories), `host.FakeEnvd` (envd's control calls) and `host.FakeHost`,
which bundles them into an `aenv.node.host.Host` and can crash and restart
them as a host whose node process died. Nothing else in the tests fakes.
"""
