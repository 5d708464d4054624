"""The benchmarks' fleets: what every bench starts, in one place.

* :mod:`bench.fleet.stack`: the whole stack as ``modelkeeper up`` runs it, on free ports in
  one folder, with N agent processes, each process in a group of its own; how to crash and
  revive a node. The recovery, sagas, temporal-cost and fuzz benches run it as it is; the
  soak's :class:`bench.soak.fleet.SoakFleet` extends it.
* :mod:`bench.fleet.scale`: that stack with one fleet process of N simulated nodes instead
  of agents, for the scale benchmark.
* :mod:`bench.fleet.nodes`: the N simulated nodes themselves, the real agent's code for
  each, run by ``python -m bench.fleet --fleet N`` (:mod:`bench.fleet.command`).
"""
