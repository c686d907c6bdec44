"""`python -m aenv.envd [--host 0.0.0.0] [--port 49983]` runs envd."""

import sys

from aenv.envd.spawnd import early_spawner

if __name__ == "__main__":
    # forked before the imports below: its copy of the interpreter stays small
    spawner = early_spawner(sys.argv[1:])

    from aenv.envd.server import main

    main(spawner=spawner)
