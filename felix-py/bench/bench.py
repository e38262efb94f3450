"""Python client throughput: Felix (this package) beside nats-py against nats-server, the same
shapes, 256-byte records. Run by scripts/python-bench.sh, which starts the servers; prints one
JSON line per run.

    python bench.py SHAPE --system felix|nats --addr HOST:PORT [--n N] [--token T --ca PEM]

Shapes:
  pub-one    one publish call per record, fire-and-forget, then wait until the server has them
  pub-batch  the same records in calls of --batch (Felix: publish_batch; nats-py has no batch
             call, so its loop is pub-one's)
  pub-ack    one acknowledged publish at a time (Felix: ack=True on a durable stream; NATS:
             JetStream js.publish on a file-backed stream)
  sub        a subscriber's receive rate while another process publishes --n records as fast
             as it can (Felix: publish_batch; NATS: publish loop)
  hop        the binding alone: an awaitable that completes at once on the client's runtime
             (what each call costs in hand-offs between Python and Rust threads)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

PAYLOAD = b"x" * 256


async def felix_client(a):
    import felix

    return await felix.connect(a.addr, token=a.token, ca=a.ca, insecure=a.ca is None)


async def nats_client(a):
    import nats

    return await nats.connect(f"nats://{a.addr}", pending_size=64 * 1024 * 1024)


async def pub(a) -> float:
    n = a.n
    if a.system == "felix":
        c = await felix_client(a)
        await c.publish_batch(a.stream, [b"warm"], ack=True)
        t = time.perf_counter()
        if a.shape == "pub-one":
            for _ in range(n):
                await c.publish(a.stream, PAYLOAD)
        elif a.shape == "pub-batch":
            batch = [PAYLOAD] * a.batch
            for _ in range(n // a.batch):
                await c.publish_batch(a.stream, batch)
        elif a.shape == "pub-ack":
            for _ in range(n):
                await c.publish(a.stream, PAYLOAD, ack=True)
        await c.flush()
        # The broker has everything once it answers an acknowledged publish sent after it.
        await c.publish_batch(a.stream, [b"end"], ack=True)
        dt = time.perf_counter() - t
        await c.close()
        return dt
    nc = await nats_client(a)
    if a.shape == "pub-ack":
        js = nc.jetstream()
        try:
            await js.add_stream(name="BENCH_" + a.stream, subjects=[a.stream])
        except Exception:
            pass
        await js.publish(a.stream, b"warm")
        t = time.perf_counter()
        for _ in range(n):
            await js.publish(a.stream, PAYLOAD)
        dt = time.perf_counter() - t
    else:
        t = time.perf_counter()
        for _ in range(n):
            await nc.publish(a.stream, PAYLOAD)
        await nc.flush()  # a PING answered after the server read everything before it
        dt = time.perf_counter() - t
    await nc.close()
    return dt


async def hop(a) -> float:
    from felix import _felix

    for _ in range(1000):
        await _felix._roundtrip()
    t = time.perf_counter()
    for _ in range(a.n):
        await _felix._roundtrip()
    return (time.perf_counter() - t) / a.n * 1e6


async def feed(a) -> None:
    """The publisher of the `sub` shape (its own process)."""
    if a.system == "felix":
        c = await felix_client(a)
        batch = [PAYLOAD] * 256
        for _ in range(a.n // 256):
            await c.publish_batch(a.stream, batch)
        await c.close()
    else:
        nc = await nats_client(a)
        for _ in range(a.n):
            await nc.publish(a.stream, PAYLOAD)
        await nc.flush()
        await nc.close()


async def sub(a) -> dict:
    n = (a.n // 256) * 256
    got = 0
    first = last = 0.0
    if a.system == "felix":
        c = await felix_client(a)
        s = await c.subscribe(a.stream, start="latest")
        feeder = subprocess.Popen([sys.executable, __file__, "feed", *sys.argv[2:]])
        try:
            while got < n:
                events = await asyncio.wait_for(s.next_events(), 10)
                if not first:
                    first = time.perf_counter()
                got += len(events)
                last = time.perf_counter()
        except asyncio.TimeoutError:
            pass
        s.close()
        await c.close()
    else:
        nc = await nats_client(a)
        done = asyncio.Event()
        count = [0, 0.0, 0.0]

        async def cb(msg):
            if not count[1]:
                count[1] = time.perf_counter()
            count[0] += 1
            count[2] = time.perf_counter()
            if count[0] >= n:
                done.set()

        await nc.subscribe(a.stream, cb=cb, pending_msgs_limit=10_000_000, pending_bytes_limit=4 << 30)
        await nc.flush()
        feeder = subprocess.Popen([sys.executable, __file__, "feed", *sys.argv[2:]])
        try:
            await asyncio.wait_for(done.wait(), 120)
        except asyncio.TimeoutError:
            pass
        # Any still arriving after the publisher stopped.
        await asyncio.sleep(0.5)
        got, first, last = count
        await nc.close()
    feeder.wait(timeout=60)
    return {"received": got, "expected": n, "seconds": last - first}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("shape", choices=["pub-one", "pub-batch", "pub-ack", "sub", "feed", "hop"])
    p.add_argument("--system", choices=["felix", "nats"], required=True)
    p.add_argument("--addr", required=True)
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--stream", default="bench")
    p.add_argument("--token")
    p.add_argument("--ca")
    p.add_argument("--label", default="")
    a = p.parse_args()
    if a.shape == "feed":
        asyncio.run(feed(a))
        return
    if a.shape == "hop":
        print(json.dumps({"system": "felix", "shape": "hop", "us_per_call": round(asyncio.run(hop(a)), 1)}))
        return
    if a.shape == "sub":
        r = asyncio.run(sub(a))
        rate = r["received"] / r["seconds"] if r["seconds"] > 0 else 0.0
        print(json.dumps({"system": a.system, "shape": a.shape, "records_per_s": round(rate), **r}))
        return
    dt = asyncio.run(pub(a))
    n = a.n if a.shape != "pub-batch" else (a.n // a.batch) * a.batch
    row = {"system": a.system, "shape": a.shape, "records": n, "seconds": round(dt, 3), "records_per_s": round(n / dt)}
    if a.label:
        row["label"] = a.label
    print(json.dumps(row))


if __name__ == "__main__":
    main()
