"""`python -m aenv.envd [--host 0.0.0.0] [--port 49983]` runs envd."""

from aenv.envd.server import main

if __name__ == "__main__":
    main()
