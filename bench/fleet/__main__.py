"""``python -m bench.fleet --fleet N [agent flags]`` (:mod:`bench.fleet.command`)."""

from bench.fleet.command import main

main()
