"""Storage: the sandbox's filesystems on the host.

`bundle` builds the self-contained envd interpreter bundle that every sandbox
sees read-only at /opt/aenv; `overlay` stacks image layers under a per-sandbox
writable upper directory with overlayfs and tears such mounts down again.
"""
