"""`python -m modelkeeper` is the `modelkeeper` command.

`up` starts its children this way (by the package name, not a script on PATH), so the
name stays. It is the one module here that is not ground floor: it only hands over to the
top room, ``cli``, and nothing imports it.
"""

from cli.main import main

main()
