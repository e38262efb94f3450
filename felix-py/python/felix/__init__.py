"""The Felix client for Python (asyncio).

Felix is a QUIC pub/sub and cache broker. This package binds the one Rust client (negotiation,
publish windows, redirects, retries and idempotent producers all live there), so a Python
program behaves exactly as a Rust one::

    import asyncio, felix

    async def main():
        client = await felix.connect("127.0.0.1:5000")      # ./felix-data's token and cert
        await client.publish("orders", b"hello")              # fire-and-forget, batched
        offset = await client.publish("orders", b"paid", ack=True)
        async with await client.subscribe("orders", start="earliest") as sub:
            async for event in sub:
                print(event.offset, event.payload)
                break
        await client.close()

    asyncio.run(main())

`felix.sync` offers the same calls without asyncio.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
from typing import Any, Deque, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union  # noqa: F401

from . import _felix
from ._felix import (  # noqa: F401  (re-exported)
    CacheChange,
    ConnectError,
    ConnectionClosed,
    CursorError,
    Draining,
    Event,
    FelixError,
    Forbidden,
    GroupRecord,
    InternalError,
    InvalidRequest,
    LeadershipLost,
    LimitExceeded,
    NotFound,
    NotLeader,
    Overloaded,
    PublishRefused,
    QuorumTimeout,
    Revoked,
    ShardUnavailable,
    StaleClaim,
    StaleWidth,
    StorageError,
    SubscriptionEnded,
    TlsError,
    Unacknowledged,
    Unauthenticated,
    Unconfirmed,
    Unsupported,
)

__version__ = _felix.__version__

# The exception classes are defined in the extension; they read as felix.X.
for _name in dir(_felix):
    _obj = getattr(_felix, _name)
    if isinstance(_obj, type) and issubclass(_obj, BaseException):
        _obj.__module__ = "felix"

Payload = Union[bytes, bytearray, memoryview, str]

#: Fire-and-forget publishes to one stream and key are sent as one batch once this many wait.
BATCH_RECORDS = 1024
#: ... or once they hold this many bytes.
BATCH_BYTES = 256 * 1024
#: Payload bytes handed to the client but not yet to the connection before a publish waits.
MAX_QUEUED_BYTES = 16 * 1024 * 1024


def _bytes(p: Payload) -> bytes:
    if isinstance(p, bytes):
        return p
    if isinstance(p, str):
        return p.encode()
    if isinstance(p, (bytearray, memoryview)):
        return bytes(p)
    raise TypeError(f"a payload is bytes (or str, encoded as UTF-8), not {type(p).__name__}")


def _addrs(addrs: Union[str, Sequence[str], None]) -> List[str]:
    if addrs is None:
        addrs = os.environ.get("FELIX_ADDR", "127.0.0.1:5000")
    if isinstance(addrs, str):
        addrs = [a.strip() for a in addrs.split(",") if a.strip()]
    out = list(addrs)
    if not out:
        raise ValueError("no broker address given")
    return out


async def connect(
    addrs: Union[str, Sequence[str], None] = None,
    *,
    token: Optional[str] = None,
    tenant: str = "default",
    namespace: str = "default",
    ca: Optional[str] = None,
    data_dir: Optional[str] = None,
    insecure: bool = False,
    server_name: Optional[str] = None,
    connect_timeout: float = 5.0,
    subscription_buffer_bytes: Optional[int] = None,
) -> "Client":
    """Connects to a broker, or to a cluster through several bootstrap addresses.

    ``addrs`` is ``"HOST:PORT"``, a comma-separated list, or a list (default ``$FELIX_ADDR`` or
    ``127.0.0.1:5000``); the first that answers is used, and requests follow redirects to the
    broker that owns each shard. Without ``token`` and ``ca`` the ones a local broker keeps in
    ``data_dir`` (default ``$FELIX_DATA_DIR`` or ``./felix-data``) are used: ``dev-token`` and
    ``tls/cert.pem``. ``ca`` may be a cluster CA's ``ca.pem``.
    """
    data_dir = data_dir or os.environ.get("FELIX_DATA_DIR", "./felix-data")
    token = token if token is not None else os.environ.get("FELIX_TOKEN")
    if token is None:
        try:
            with open(os.path.join(data_dir, "dev-token")) as f:
                token = f.read().strip()
        except OSError:
            raise ValueError(
                f"no token: pass token=, set FELIX_TOKEN, or run beside the broker's data directory ({data_dir})"
            ) from None
    ca = ca or os.environ.get("FELIX_CA")
    if ca is None and not insecure:
        ca = os.path.join(data_dir, "tls", "cert.pem")
        if not os.path.exists(ca):
            raise ValueError(
                f"no certificate to trust: pass ca= (the broker's cert.pem or the cluster CA's ca.pem); {ca} does not exist"
            )
    raw = await _felix.RawClient.connect(
        _addrs(addrs), tenant, token, ca, insecure, server_name, connect_timeout, subscription_buffer_bytes
    )
    return Client(raw, namespace)


class StreamEntry(NamedTuple):
    namespace: str
    stream: str
    shards: int


class Client:
    """A connection to a broker or a cluster. Made by :func:`connect`; also an async context
    manager that closes it."""

    def __init__(self, raw: Any, namespace: str = "default") -> None:
        self._raw = raw
        self.namespace = namespace
        self._pending: Dict[Tuple[str, str, Optional[bytes]], List[bytes]] = {}
        self._pending_bytes: Dict[Tuple[str, str, Optional[bytes]], int] = {}
        self._queued = 0
        self._flush_scheduled = False

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- publishing ---------------------------------------------------------------------------

    async def publish(
        self,
        stream: str,
        payload: Payload,
        *,
        key: Optional[Payload] = None,
        ack: bool = False,
        namespace: Optional[str] = None,
    ) -> Optional[int]:
        """Publishes one record.

        With ``ack=True`` waits until the broker stored it (per the stream's fsync policy) and
        returns its offset. Without, it is queued and sent with the records published around
        it in one batch (at the next turn of the event loop, or once ``BATCH_RECORDS`` wait);
        records to one stream keep their order, acknowledged or not. ``flush()`` or ``close()``
        waits until everything queued was handed over, and a failure to send is raised by the
        next ``publish`` or ``flush``.
        """
        ns = namespace or self.namespace
        k = _bytes(key) if key is not None else None
        p = _bytes(payload)
        slot = (ns, stream, k)
        if ack:
            await self._before_acked(slot)
            return await self._raw.publish(ns, stream, [p], k, True)
        batch = self._pending.get(slot)
        if batch is None:
            self._raw.take_error()  # an earlier batch's failure, once per new batch
            batch = self._pending[slot] = []
            self._pending_bytes[slot] = 0
        batch.append(p)
        size = self._pending_bytes[slot] = self._pending_bytes[slot] + len(p)
        if len(batch) >= BATCH_RECORDS or size >= BATCH_BYTES:
            self._send(slot)
            if self._queued > MAX_QUEUED_BYTES:
                await self._raw.flush()
                self._queued = 0
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._send_all)
        return None

    async def publish_batch(
        self,
        stream: str,
        payloads: Iterable[Payload],
        *,
        key: Optional[Payload] = None,
        ack: bool = False,
        namespace: Optional[str] = None,
    ) -> Optional[int]:
        """Publishes records as one batch (one frame, one write); with ``ack=True`` returns the
        first record's offset once stored. Without, the batch is queued (in order behind what
        was published before it) and this returns at once."""
        ns = namespace or self.namespace
        k = _bytes(key) if key is not None else None
        batch = [_bytes(p) for p in payloads]
        if not batch:
            return None
        slot = (ns, stream, k)
        if ack:
            await self._before_acked(slot)
            return await self._raw.publish(ns, stream, batch, k, True)
        self._raw.take_error()
        self._send(slot)
        self._queued = self._raw.publish_nowait(ns, stream, batch, k)
        if self._queued > MAX_QUEUED_BYTES:
            await self._raw.flush()
            self._queued = 0
        return None

    async def _before_acked(self, slot: Tuple[str, str, Optional[bytes]]) -> None:
        """An acknowledged publish goes straight to the client: what is queued for its stream
        goes first."""
        self._raw.take_error()
        if slot in self._pending or self._queued:
            self._send_all()
            await self._raw.flush()
            self._queued = 0

    def _send(self, slot: Tuple[str, str, Optional[bytes]]) -> None:
        batch = self._pending.pop(slot, None)
        self._pending_bytes.pop(slot, None)
        if batch:
            self._queued = self._raw.publish_nowait(slot[0], slot[1], batch, slot[2])

    def _send_all(self) -> None:
        self._flush_scheduled = False
        for slot in list(self._pending):
            self._send(slot)

    async def flush(self) -> None:
        """Waits until every fire-and-forget publish was handed to the connection; raises the
        first failure since the last call."""
        self._send_all()
        await self._raw.flush()
        self._queued = 0

    async def producer(self, stream: str, *, namespace: Optional[str] = None) -> "Producer":
        """An idempotent producer: every batch it sends is appended exactly once, across
        reconnections and fail-overs."""
        return Producer(await self._raw.producer(namespace or self.namespace, stream))

    # -- reading ------------------------------------------------------------------------------

    async def subscribe(
        self,
        stream: str,
        *,
        start: Union[str, int, None] = "latest",
        shard: int = 0,
        namespace: Optional[str] = None,
        buffer_batches: int = 64,
    ) -> "Subscription":
        """Subscribes to one shard from ``start`` (``"latest"``, ``"earliest"`` or an offset).
        The subscription follows the shard when it moves or its broker fails over. Iterate it
        with ``async for``; a subscription that cannot go on raises (``SubscriptionEnded``, or
        the broker's refusal)."""
        raw = await self._raw.subscribe(namespace or self.namespace, stream, start, shard, buffer_batches)
        return Subscription(raw)

    # -- caches and counters ------------------------------------------------------------------

    async def cache_put(
        self,
        cache: str,
        key: str,
        value: Payload,
        *,
        ttl: Optional[float] = None,
        namespace: Optional[str] = None,
    ) -> None:
        """Stores a value; ``ttl`` in seconds."""
        ttl_ms = None if ttl is None else max(1, int(ttl * 1000))
        await self._raw.cache_put(namespace or self.namespace, cache, key, _bytes(value), ttl_ms)

    async def cache_get(self, cache: str, key: str, *, namespace: Optional[str] = None) -> Optional[bytes]:
        """A value, or ``None`` on a miss or after expiry."""
        return await self._raw.cache_get(namespace or self.namespace, cache, key)

    async def cache_delete(self, cache: str, key: str, *, namespace: Optional[str] = None) -> Optional[bytes]:
        """Deletes a key; the value it held, or ``None``."""
        return await self._raw.cache_delete(namespace or self.namespace, cache, key)

    async def cache_watch(
        self,
        cache: str,
        *,
        key: Optional[str] = None,
        prefix: Optional[str] = None,
        from_offset: Optional[int] = None,
        retained: bool = False,
        namespace: Optional[str] = None,
    ) -> "Watch":
        """Watches one key (``key``) or every key starting with ``prefix`` (default: every key):
        from now, from a change offset, or starting with the current values (``retained``)."""
        raw = await self._raw.cache_watch(namespace or self.namespace, cache, key, prefix, from_offset, retained)
        return Watch(raw)

    async def counter_add(self, cache: str, key: str, delta: int = 1, *, namespace: Optional[str] = None) -> int:
        """Adds ``delta`` to a counter; its new value."""
        return await self._raw.counter_add(namespace or self.namespace, cache, key, delta)

    async def counter_get(self, cache: str, key: str, *, namespace: Optional[str] = None) -> Optional[int]:
        """A counter's value, or ``None`` when it was never set."""
        return await self._raw.counter_get(namespace or self.namespace, cache, key)

    # -- consumer groups ----------------------------------------------------------------------

    async def group_poll(
        self,
        stream: str,
        group: str,
        *,
        max_records: int = 100,
        wait: float = 0.0,
        shard: int = 0,
        consumer: Optional[str] = None,
        visibility: float = 0.0,
        namespace: Optional[str] = None,
    ) -> List[GroupRecord]:
        """Claims up to ``max_records`` records of the group (waiting up to ``wait`` seconds for
        some); each is redelivered unless acknowledged within ``visibility`` (the broker's
        default when 0)."""
        ns = namespace or self.namespace
        return await self._raw.group_poll(ns, stream, group, shard, max_records, wait, consumer, visibility)

    async def group_ack(
        self, stream: str, group: str, offset: int, *, shard: int = 0, namespace: Optional[str] = None
    ) -> None:
        """Finishes a record."""
        await self._raw.group_ack(namespace or self.namespace, stream, group, offset, shard)

    async def group_nack(
        self,
        stream: str,
        group: str,
        offset: int,
        *,
        delay: Optional[float] = None,
        shard: int = 0,
        namespace: Optional[str] = None,
    ) -> None:
        """Gives a record back to be handed out again (after ``delay`` seconds)."""
        await self._raw.group_nack(namespace or self.namespace, stream, group, offset, shard, delay)

    # -- operators ----------------------------------------------------------------------------

    async def stream_list(self, namespace: Optional[str] = None) -> List[StreamEntry]:
        """The tenant's streams this token may publish to or read."""
        return [StreamEntry(*e) for e in await self._raw.stream_list(namespace)]

    async def cluster_status(self) -> Dict[str, Any]:
        """The cluster as the broker sees it (``{"cluster": False}`` for a single broker)."""
        return json.loads(await self._raw.cluster_status())

    async def close(self) -> None:
        """Sends what is queued, then closes, waiting for the broker to confirm it."""
        try:
            await self.flush()
        finally:
            await self._raw.close()


class Subscription:
    """A subscription: ``async for event in sub``. Closed by ``close()``, ``async with``, or
    when dropped."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._buffer: Deque[Event] = collections.deque()
        self.shard: int = raw.shard

    def __aiter__(self) -> "Subscription":
        return self

    async def __anext__(self) -> Event:
        if not self._buffer:
            events = await self._raw.next_events()
            if events is None:
                raise StopAsyncIteration
            self._buffer.extend(events)
        return self._buffer.popleft()

    async def next_events(self) -> List[Event]:
        """Every event already received (at least one); ``[]`` once closed."""
        if self._buffer:
            out = list(self._buffer)
            self._buffer.clear()
            return out
        return (await self._raw.next_events()) or []

    @property
    def resumes(self) -> int:
        """How many times the subscription was made again: its shard moved, its broker failed,
        or it fell behind the broker's queue and resumed where it left off (no gap on a
        durable stream)."""
        return self._raw.resumes

    @property
    def last_end(self) -> Optional[str]:
        """Why it was last made again, for a person to read."""
        return self._raw.last_end

    def close(self) -> None:
        self._raw.close()

    async def __aenter__(self) -> "Subscription":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


class Watch:
    """A cache watch: ``async for change in watch``."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._buffer: Deque[CacheChange] = collections.deque()

    def __aiter__(self) -> "Watch":
        return self

    async def __anext__(self) -> CacheChange:
        if not self._buffer:
            changes = await self._raw.next_changes()
            if changes is None:
                raise StopAsyncIteration
            self._buffer.extend(changes)
        return self._buffer.popleft()

    def close(self) -> None:
        self._raw.close()

    async def __aenter__(self) -> "Watch":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


class Producer:
    """An idempotent producer for one stream (:meth:`Client.producer`)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    async def send(self, payloads: Union[Payload, Iterable[Payload]], *, key: Optional[Payload] = None) -> Optional[int]:
        """Sends one record or a batch and waits until it is appended, exactly once; the first
        offset."""
        batch = [_bytes(payloads)] if isinstance(payloads, (bytes, bytearray, memoryview, str)) else [_bytes(p) for p in payloads]
        return await self._raw.send(batch, None if key is None else _bytes(key))

    async def submit(self, payloads: Union[Payload, Iterable[Payload]], *, key: Optional[Payload] = None) -> None:
        """Queues a batch without waiting for it to be appended; :meth:`flush` waits for all."""
        batch = [_bytes(payloads)] if isinstance(payloads, (bytes, bytearray, memoryview, str)) else [_bytes(p) for p in payloads]
        await self._raw.submit(batch, None if key is None else _bytes(key))

    async def flush(self) -> None:
        await self._raw.flush()

    async def producer_id(self) -> Optional[int]:
        return await self._raw.producer_id()

    async def close(self) -> None:
        await self._raw.close()

    async def __aenter__(self) -> "Producer":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
