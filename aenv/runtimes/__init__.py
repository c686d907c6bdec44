"""Runtime drivers: how a sandbox's isolated kernel/VM is started and stopped.

`base` holds the runtime-neutral interface; `gvisor` is the runsc driver;
`netns` owns per-sandbox network slots (netns, veth, nftables).
"""
