"""envd's entry point: `python -m aenv.envd [--host 0.0.0.0] [--port 49983]`.

In a sandbox it starts as `python -S -P -OO -c 'from aenv.envd.__main__
import main; main()' ... --guard` (`aenv.storage.bundle.envd_command`): not
through `-m`, whose `runpy` (≈ 1 MiB of heap) would be imported before the
spawner is forked and so held twice (see `aenv.envd.spawnd`).
"""

import sys

from aenv.envd.spawnd import early_spawner


def main() -> None:
    # forked before the imports below: its copy of the interpreter stays small
    spawner = early_spawner(sys.argv[1:])

    from aenv.envd import slim

    slim.install()  # (before trio and Hypercorn import what envd never uses)
    from aenv.envd.server import main as serve

    serve(spawner=spawner)


if __name__ == "__main__":
    main()
