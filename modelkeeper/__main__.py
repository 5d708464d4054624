"""`python -m modelkeeper` is the `modelkeeper` command."""

from .launcher.cli import main

main()
