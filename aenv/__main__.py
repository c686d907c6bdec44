"""`python -m aenv` is the `aenv` command."""

from aenv.cli import main

if __name__ == "__main__":
    main()
