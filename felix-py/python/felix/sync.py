"""The Felix client without asyncio: each call runs the asyncio client on an event loop the
client owns, so the GIL is released while it waits for the broker.

    from felix.sync import connect
    with connect("127.0.0.1:5000") as client:
        client.publish("orders", b"hello", ack=True)
        for event in client.subscribe("orders", start="earliest", timeout=5):
            print(event.offset, event.payload)
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterator, List, Optional

import felix


def connect(*args: Any, **kwargs: Any) -> "Client":
    """As :func:`felix.connect`, without asyncio."""
    return Client(*args, **kwargs)


class Client:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._client: felix.Client = self._loop.run_until_complete(felix.connect(*args, **kwargs))

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def publish(self, stream: str, payload: Any, **kw: Any) -> Optional[int]:
        """Publishes one record (``ack=True`` waits and returns its offset; without, it is queued
        for the client's own threads to send, in order, and a failure is raised by a later call
        or by ``close()``)."""
        if kw.get("ack"):
            return self._run(self._client.publish(stream, payload, **kw))
        return self._run(self._client.publish_batch(stream, [payload], **kw))

    def publish_batch(self, stream: str, payloads: Any, **kw: Any) -> Optional[int]:
        return self._run(self._client.publish_batch(stream, payloads, **kw))

    def cache_put(self, cache: str, key: str, value: Any, **kw: Any) -> None:
        self._run(self._client.cache_put(cache, key, value, **kw))

    def cache_get(self, cache: str, key: str, **kw: Any) -> Optional[bytes]:
        return self._run(self._client.cache_get(cache, key, **kw))

    def cache_delete(self, cache: str, key: str, **kw: Any) -> Optional[bytes]:
        return self._run(self._client.cache_delete(cache, key, **kw))

    def counter_add(self, cache: str, key: str, delta: int = 1, **kw: Any) -> int:
        return self._run(self._client.counter_add(cache, key, delta, **kw))

    def counter_get(self, cache: str, key: str, **kw: Any) -> Optional[int]:
        return self._run(self._client.counter_get(cache, key, **kw))

    def group_poll(self, stream: str, group: str, **kw: Any) -> List[felix.GroupRecord]:
        return self._run(self._client.group_poll(stream, group, **kw))

    def group_ack(self, stream: str, group: str, offset: int, **kw: Any) -> None:
        self._run(self._client.group_ack(stream, group, offset, **kw))

    def group_nack(self, stream: str, group: str, offset: int, **kw: Any) -> None:
        self._run(self._client.group_nack(stream, group, offset, **kw))

    def stream_list(self, namespace: Optional[str] = None) -> List[felix.StreamEntry]:
        return self._run(self._client.stream_list(namespace))

    def cluster_status(self) -> Any:
        return self._run(self._client.cluster_status())

    def subscribe(self, stream: str, *, timeout: Optional[float] = None, **kw: Any) -> "Subscription":
        """A subscription to iterate; with ``timeout`` (seconds), iteration stops when no event
        came for that long."""
        return Subscription(self, self._run(self._client.subscribe(stream, **kw)), timeout)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._client.close())
        finally:
            self._loop.close()


class Subscription:
    def __init__(self, owner: Client, sub: felix.Subscription, timeout: Optional[float]) -> None:
        self._owner, self._sub, self._timeout = owner, sub, timeout

    def __iter__(self) -> Iterator[felix.Event]:
        return self

    def __next__(self) -> felix.Event:
        try:
            if self._timeout is None:
                return self._owner._run(self._sub.__anext__())
            return self._owner._run(asyncio.wait_for(self._sub.__anext__(), self._timeout))
        except (StopAsyncIteration, asyncio.TimeoutError):
            raise StopIteration from None

    def close(self) -> None:
        self._sub.close()

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
