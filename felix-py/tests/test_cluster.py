"""The Python client against a three-broker cluster with one CA: bootstrap through several
addresses trusting only the CA, and a replicated stream whose leader is killed mid-stream while
a subscriber reads and a publisher writes."""

from __future__ import annotations

import asyncio
import time

import felix

from conftest import TOKEN

UNKNOWN = (felix.ConnectionClosed, felix.QuorumTimeout, felix.LeadershipLost, felix.Unacknowledged, felix.InternalError)
REFUSED = (felix.ShardUnavailable, felix.NotLeader, felix.Draining, felix.ConnectError, felix.Overloaded)


async def publish_until_answered(c: felix.Client, payload: bytes, deadline: float):
    """The record's offset once acknowledged; `None` when its outcome is unknown (it may or
    may not have been written; never sent twice)."""
    while True:
        try:
            return await c.publish("ledger", payload, ack=True)
        except REFUSED:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
        except UNKNOWN:
            return None


async def test_a_replicated_stream_survives_its_leader_killed_mid_stream(cluster):
    brokers, ca = cluster
    c = await felix.connect([b.addr for b in brokers], token=TOKEN, ca=ca)
    deadline = time.monotonic() + 60
    acked = {}
    for i in range(30):
        off = await publish_until_answered(c, f"r{i}".encode(), deadline)
        if off is not None:
            acked[off] = f"r{i}".encode()
    sub = await c.subscribe("ledger", start="earliest")
    seen = {}

    async def read_until(offsets):
        # Offsets need not be contiguous: a replicated shard may skip some (shown to a
        # subscriber as skipped_before), e.g. where a new leader took over.
        while not set(offsets) <= set(seen):
            ev = await sub.__anext__()
            assert ev.offset not in seen or seen[ev.offset] == ev.payload, "no offset read twice differently"
            seen[ev.offset] = ev.payload

    await asyncio.wait_for(read_until(list(acked)), 30)
    status = await c.cluster_status()
    assert len(status["members"]) == 3
    owner = next(s["owner"] for s in status["shards"] if s["name"] == "ledger")
    addr = next(m["client_addr"] for m in status["members"] if m["node_id"] == owner)
    victim = next(b for b in brokers if b.addr == addr)
    victim.kill()
    for i in range(30, 60):
        off = await publish_until_answered(c, f"r{i}".encode(), time.monotonic() + 60)
        if off is not None:
            acked[off] = f"r{i}".encode()
    assert len(acked) >= 55, f"publishing goes on through the fail-over: {len(acked)} acknowledged"
    try:
        await asyncio.wait_for(read_until(list(acked)), 60)
    except asyncio.TimeoutError:
        missing = sorted(set(acked) - set(seen))
        raise AssertionError(f"acknowledged records never read: {missing[:20]} (read {len(seen)})") from None
    assert sorted(seen) == list(seen), "offsets delivered in order"
    for off, payload in acked.items():
        assert seen.get(off) == payload, f"acknowledged record at {off} read back"
    assert sub.resumes >= 1 and sub.last_end, "the fail-over is reported, not hidden"
    sub.close()
    await c.close()


async def test_the_cluster_ca_alone_is_trusted_for_every_broker(cluster):
    brokers, ca = cluster
    for b in brokers:
        async with await felix.connect(b.addr, token=TOKEN, ca=ca) as c:
            status = await c.cluster_status()
            assert status["cluster"] is True and status["node_id"] in ("n1", "n2", "n3")
