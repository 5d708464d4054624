"""`python -m modelkeeper` is the `modelkeeper` command."""

from .cli import main

main()
