"""The Python client against a single broker: publishing (batched fire-and-forget, acked,
idempotent), subscribing, caches and watches, counters, consumer groups, listing, typed errors,
and the synchronous wrapper."""

from __future__ import annotations

import asyncio

import felix
import felix.sync
import pytest

from conftest import TOKEN


async def client_of(broker, **kw) -> felix.Client:
    return await felix.connect(broker.addr, token=TOKEN, ca=broker.cert(), **kw)


async def test_published_records_arrive_in_order_with_offsets(broker):
    async with await client_of(broker) as c:
        first = await c.publish("orders", b"r0", ack=True)
        assert first == 0
        for i in range(1, 2000):
            await c.publish("orders", f"r{i}".encode())  # batched, fire-and-forget
        await c.flush()
        last = await c.publish_batch("orders", [b"x", b"y"], ack=True)
        assert last == 2000, "every fire-and-forget record was written before the acked batch"
        sub = await c.subscribe("orders", start="earliest")
        got = []
        async for ev in sub:
            got.append((ev.offset, ev.payload))
            if len(got) == 2002:
                break
        sub.close()
        assert got[:3] == [(0, b"r0"), (1, b"r1"), (2, b"r2")]
        assert got[-1] == (2001, b"y")
        assert [o for o, _ in got] == list(range(2002))


async def test_a_live_subscriber_gets_what_is_published_after_it_joined(broker):
    async with await client_of(broker) as c:
        async with await c.subscribe("live") as sub:
            await c.publish_batch("live", [b"a", b"b", b"c"], ack=True)
            got = [await sub.__anext__() for _ in range(3)]
        assert [e.payload for e in got] == [b"a", b"b", b"c"]
        assert all(e.shard == 0 for e in got)


async def test_caches_counters_and_a_watch(broker):
    async with await client_of(broker) as c:
        assert await c.cache_get("sessions", "u1") is None
        watch = await c.cache_watch("sessions", prefix="u")
        await c.cache_put("sessions", "u1", b"alice")
        assert await c.cache_get("sessions", "u1") == b"alice"
        assert await c.cache_delete("sessions", "u1") == b"alice"
        assert await c.cache_get("sessions", "u1") is None
        changes = [await watch.__anext__() for _ in range(2)]
        watch.close()
        assert [(ch.key, ch.value) for ch in changes] == [("u1", b"alice"), ("u1", None)]
        assert changes[0].offset < changes[1].offset
        assert await c.counter_add("hits", "page", 5) == 5
        assert await c.counter_add("hits", "page", -2) == 3
        assert await c.counter_get("hits", "page") == 3
        assert await c.counter_get("hits", "never") is None


async def test_a_consumer_group_hands_out_acks_and_redelivers(broker):
    async with await client_of(broker) as c:
        await c.publish_batch("jobs", [b"j0", b"j1", b"j2"], ack=True)
        got = await c.group_poll("jobs", "workers", max_records=10)
        assert [r.payload for r in got] == [b"j0", b"j1", b"j2"]
        assert all(r.attempts == 1 for r in got)
        await c.group_ack("jobs", "workers", got[0].offset)
        await c.group_nack("jobs", "workers", got[1].offset)
        again = await c.group_poll("jobs", "workers", max_records=10)
        assert [(r.offset, r.attempts) for r in again] == [(1, 2)]
        with pytest.raises(felix.FelixError):
            await c.group_ack("jobs", "workers", 99)


async def test_an_idempotent_producer_appends_each_batch_once(broker):
    async with await client_of(broker) as c:
        async with await c.producer("ledger") as p:
            assert await p.producer_id() is not None
            assert await p.send(b"a") == 0
            assert await p.send([b"b", b"c"]) == 1
            for i in range(10):
                await p.submit(f"q{i}".encode())
            await p.flush()
        sub = await c.subscribe("ledger", start="earliest")
        got = [(await sub.__anext__()).payload for _ in range(13)]
        sub.close()
        assert got == [b"a", b"b", b"c"] + [f"q{i}".encode() for i in range(10)]


async def test_errors_are_typed_and_carry_the_broker_code(broker):
    async with await client_of(broker) as c:
        with pytest.raises(felix.CursorError) as e:
            await c.subscribe("empty-stream", start=50)
        assert e.value.available == 0 and e.value.requested == 50
        with pytest.raises(ValueError):
            await c.subscribe("orders", start="yesterday")
        with pytest.raises(TypeError):
            await c.publish("orders", 12)
    with pytest.raises(felix.Unauthenticated) as e:
        await felix.connect(broker.addr, token="wrong", ca=broker.cert())
    assert e.value.code == "unauthenticated" and e.value.retry == "fatal"
    assert isinstance(e.value, felix.FelixError)
    with pytest.raises(felix.TlsError):
        await felix.connect(broker.addr, token=TOKEN, ca="/nonexistent/cert.pem")
    with pytest.raises(felix.ConnectError):
        await felix.connect("127.0.0.1:1", token=TOKEN, ca=broker.cert(), connect_timeout=0.5)


async def test_listing_and_status(broker):
    async with await client_of(broker) as c:
        await c.publish("audit", b"x", ack=True)
        assert felix.StreamEntry("default", "audit", 1) in await c.stream_list()
        assert await c.cluster_status() == {"cluster": False}


async def test_the_data_directory_gives_token_and_certificate(broker, monkeypatch):
    monkeypatch.setenv("FELIX_DATA_DIR", str(broker.dir))
    async with await felix.connect(broker.addr) as c:
        assert await c.publish("orders", b"found", ack=True) == 0
    with pytest.raises(ValueError, match="no token"):
        await felix.connect(broker.addr, data_dir="/nonexistent")


async def test_a_subscriber_with_small_buffers_reads_a_large_backlog_without_loss(broker):
    async with await client_of(broker, subscription_buffer_bytes=64 * 1024) as c:
        sub = await c.subscribe("firehose", start="earliest", buffer_batches=2)
        payload = b"z" * 1000
        for _ in range(20):
            await c.publish_batch("firehose", [payload] * 500, ack=True)
        # Nothing read yet: the client holds at most its buffers; the broker waits on flow control.
        got = 0
        async for ev in sub:
            assert ev.offset == got
            got += 1
            if got == 10_000:
                break
        sub.close()


def test_the_synchronous_client(broker):
    with felix.sync.connect(broker.addr, token=TOKEN, ca=broker.cert()) as c:
        assert c.publish("sync", b"one", ack=True) == 0
        c.publish("sync", b"two")
        c.cache_put("kv", "k", b"v")
        assert c.cache_get("kv", "k") == b"v"
        assert c.counter_add("n", "k") == 1
        got = [e.payload for e in c.subscribe("sync", start="earliest", timeout=2)]
        assert got == [b"one", b"two"]


async def test_fire_and_forget_batches_keep_their_order_and_failures_surface(broker):
    async with await client_of(broker) as c:
        expected = []
        for i in range(300):
            if i % 3 == 0:
                batch = [f"b{i}-{j}".encode() for j in range(50)]
                await c.publish_batch("ordered", batch)
                expected += batch
            else:
                p = f"p{i}".encode()
                await c.publish("ordered", p)
                expected.append(p)
        tail = await c.publish("ordered", b"last", ack=True)
        assert tail == len(expected), "the acked record went after every queued one"
        sub = await c.subscribe("ordered", start="earliest")
        got = []
        while len(got) < len(expected) + 1:
            got += [e.payload for e in await sub.next_events()]
        sub.close()
        assert got == expected + [b"last"]
        # A batch the client cannot send: the failure comes back from flush, typed.
        await c.publish("x" * 300, b"never")
        with pytest.raises(felix.FelixError):
            await c.flush()
        await c.flush()  # reported once


EXIT_SCRIPT = """
import asyncio, sys, felix
async def main():
    c = await felix.connect(sys.argv[1], token=sys.argv[2], ca=sys.argv[3])
    await c.publish("exits", b"x", ack=True)
    sub = await c.subscribe("exits", start="earliest")
    await sub.__anext__()
    pending = asyncio.ensure_future(sub.__anext__())   # still waiting when the process ends
    await c.publish_batch("exits", [b"y"] * 100)
    if sys.argv[4] == "close":
        await c.close()
asyncio.run(main())
"""


def test_a_process_exits_cleanly_with_futures_still_completing(broker):
    """Interpreter exit while Rust futures complete (an acked publish just answered, a
    subscription still waiting, the connection open or closing) neither crashes nor hangs: a
    completion racing Py_Finalize once crashed about one exit in five."""
    import subprocess
    import sys

    for i in range(12):
        how = "close" if i % 2 == 0 else "leave"
        r = subprocess.run(
            [sys.executable, "-c", EXIT_SCRIPT, broker.addr, TOKEN, broker.cert(), how],
            capture_output=True,
            timeout=60,
        )
        assert r.returncode == 0, f"exit {i} ({how}): rc {r.returncode}: {r.stderr.decode()[-2000:]}"
