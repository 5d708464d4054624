"""Link health inside a multi-node replica: each rank above 0 checks, while it runs, that
it can still reach rank 0's rendezvous address.

A rank that cannot reach rank 0 is useless even while its process lives: the engines'
collectives hang until a timeout of minutes (NCCL's default is 10). And when rank 0's
node comes back under another address, the ranks hold the old one. So the agent that runs
the rank says so with the reason, and the replica is replaced whole (the watch of this
shard ends with :attr:`~modelkeeper.domain.shards.ExitKind.LINK_LOST`).

A check is a TCP connect and close, which the engines' rendezvous servers (torch's
TCPStore for vLLM and SGLang, the sim's) take as nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.shards import ShardSpec, split_address

log = logging.getLogger(__name__)

#: Between two checks of one rank's link: a lost link is named within about
#: LINK_FAILURES x this, well before the engines' own collective timeouts.
LINK_CHECK_INTERVAL_S = 2.0
#: One connect: on a working link it takes a round trip; this much means the address
#: does not answer.
LINK_CONNECT_TIMEOUT_S = 2.0
#: Checks that must fail in a row before the link counts as lost: one lost SYN under load
#: must not replace a replica.
LINK_FAILURES = 3


@dataclass
class LinkWatch:
    """The link from one rank above 0 to rank 0, checked every LINK_CHECK_INTERVAL_S."""

    node_id: NodeId
    rank: int
    address: str
    host: str
    port: int
    failures: int = 0
    first_failure_at: float | None = None
    last_error: str = ""
    next_check_at: float = 0.0

    @classmethod
    def of(cls, spec: ShardSpec) -> LinkWatch | None:
        """The watch for ``spec``, or None for a shard that rendezvouses with nobody."""
        if spec.rank == 0 or spec.world_size <= 1 or not spec.leader_address:
            return None
        parts = split_address(spec.leader_address)
        if parts is None:
            return None
        return cls(node_id=spec.node_id, rank=spec.rank, address=spec.leader_address,
                   host=parts[0], port=parts[1])

    async def poll(self, now: float) -> str | None:
        """Check the link when one is due; the reason once it counts as lost, else None."""
        if now < self.next_check_at:
            return None
        self.next_check_at = now + LINK_CHECK_INTERVAL_S
        error = await self._connect()
        if error is None:
            if self.failures:
                log.info("rank %d reaches rank 0 at %s again", self.rank, self.address)
            self.failures, self.first_failure_at = 0, None
            return None
        self.failures += 1
        self.last_error = error
        if self.first_failure_at is None:
            self.first_failure_at = now
        log.warning("rank %d cannot reach rank 0 at %s (%d of %d): %s", self.rank,
                    self.address, self.failures, LINK_FAILURES, error)
        if self.failures < LINK_FAILURES:
            return None
        return (f"rank {self.rank} on node {self.node_id} cannot reach rank 0's rendezvous "
                f"at {self.address}: {error} ({self.failures} checks in a row over "
                f"{now - self.first_failure_at:.0f}s)")

    async def _connect(self) -> str | None:
        try:
            async with asyncio.timeout(LINK_CONNECT_TIMEOUT_S):
                _, writer = await asyncio.open_connection(self.host, self.port)
        except TimeoutError:
            return f"no answer within {LINK_CONNECT_TIMEOUT_S:.0f}s"
        except OSError as exc:
            # asyncio's own strerror repeats the address ("Connect call failed (...)").
            return os.strerror(exc.errno) if exc.errno else type(exc).__name__
        writer.close()
        return None
