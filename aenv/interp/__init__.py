"""The code interpreter that runs inside `code-interpreter-v1` sandboxes.

`server` is the code-execution server the E2B code-interpreter SDKs talk to
on port 49999 (`/execute`, `/contexts`); `kernel` is loaded into each Jupyter
kernel it starts (result formats, chart data, per-run environment). Neither
runs on the node: the guest's own Python (which has `jupyter_client`,
`ipykernel` and the data stack) runs them from the envd bundle, as scripts,
so they import nothing from aenv and only the standard library at the top.
"""
