"""Where a node stands in the facility, and what a deployment asks of it: topology labels,
spread over a topology key, and power caps. Pure values; :mod:`.placement` applies them.

**Topology labels.** A node says where it is with three labels, from its agent's
``labels`` or an operator's (``PATCH /nodes/{id}``), the operator's outranking:

* ``topology.zone``: the zone (a building, a hall: what one cooling or network fault
  takes down);
* ``topology.rack``: the rack;
* ``topology.pdu``: the power distribution unit feeding it, which power caps count.

A node without one of them is simply not in any domain of that key.

**Spread.** A deployment may ask that its replicas' shards spread over a key with a
maximum skew, as Kubernetes' topology spread constraints do: after placing, the count of
the deployment's shards in any domain of that key may exceed the count in the emptiest
eligible domain by at most ``max_skew``.

**Power caps.** Each shard of a model declares the watts it draws (``watts`` in the
catalog). A PDU may have a cap, and the whole facility one (stored under
:data:`FACILITY_CAP_KEY`): a shard is not placed where it would take its node's PDU, or
the facility, past its cap.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, StringConstraints

from .base import Frozen
from .bounds import JsonInt


class TopologyKey(StrEnum):
    """A topology key a deployment may spread over."""

    ZONE = "zone"
    RACK = "rack"
    PDU = "pdu"

    @property
    def label(self) -> str:
        """The node label that carries it: ``topology.rack`` for ``rack``."""
        return TOPOLOGY_LABEL_PREFIX + self.value


#: Topology labels are ``topology.<key>``: one prefix, so an operator sees them together.
TOPOLOGY_LABEL_PREFIX = "topology."
ZONE_LABEL = TopologyKey.ZONE.label
RACK_LABEL = TopologyKey.RACK.label
PDU_LABEL = TopologyKey.PDU.label

#: The most skew a spread may allow: past a deployment's replica bound (64) it says
#: nothing, so a larger value is a typo.
MAX_SKEW = 64


class Spread(Frozen):
    """Spread a deployment's shards over ``key``: after placing, the shards in any domain
    exceed those in the emptiest eligible domain by at most ``max_skew``."""

    key: TopologyKey
    max_skew: JsonInt = Field(default=1, ge=1, le=MAX_SKEW)


#: The power cap of the whole facility is stored, and set, under this name. A PDU label
#: value cannot start with an underscore in any naming scheme we know of (Kubernetes'
#: label values start with an alphanumeric), so it cannot be a PDU's name.
FACILITY_CAP_KEY = "_facility"
#: The largest power cap or declared draw: 1 GW, past any facility, and within an integer.
MAX_WATTS = 1_000_000_000
#: A PDU's name as a power cap names it: a label value's bound.
PduName = Annotated[str, StringConstraints(min_length=1, max_length=253,
                                           pattern=r"^[^\x00/]+$")]


class PowerCap(Frozen):
    """PUT /power-caps/{pdu}: the most watts the PDU's nodes may draw together, counted
    from the declared watts of the shards placed on them."""

    watts: JsonInt = Field(ge=0, le=MAX_WATTS)
