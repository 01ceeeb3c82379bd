"""FanoutClient: the tensors of one checkpoint spread over several qmill replicas.

Each replica gets one QuantizeParams stream (a client.Client of its own, opened for the call).
Replicas pull tensors from one shared feed when they have room (at most `tensors_per_replica`
tensors, and a share of the byte window, sent or answered but not yet taken by the caller), so a
faster replica simply takes more. A replica whose stream fails with a transport-like status
(UNAVAILABLE, INTERNAL, CANCELLED, …) is dropped for the rest of the call and the tensors it had
not answered go back to the front of the feed for the others; a status that describes the request
(INVALID_ARGUMENT, UNAUTHENTICATED, …) would fail on every replica and is raised at once. When
every replica has failed, the last error is raised: the CLI's retry (retry.call) then starts again,
resuming.

`streams=N` opens N streams per replica (each on a channel and TCP connection of its own), so one
client drives N concurrent QuantizeParams calls even to a single server: while one stream's
tensor is being quantized, another's is on the wire. A lost stream is handled as a lost replica.

Outcomes are yielded as they complete, NOT in input order: pipeline.quantize_checkpoint records each
one under its entry number and writes the checkpoint in checkpoint order afterwards, so the
checkpoint is byte for byte the one a single server gives.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from qmill.checkpoints.run import outcome as outcome_lib
from qmill.client import client as client_lib
from qmill.client import credentials as credentials_lib
from qmill.client import errors, recipes, streaming

# Statuses that say "this replica is gone or broke the stream", not "this request is wrong".
RETRY_ON_ANOTHER = frozenset(
    {"UNAVAILABLE", "INTERNAL", "UNKNOWN", "DATA_LOSS", "ABORTED", "CANCELLED"}
)

# Seconds an early exit waits for the replicas to finish their streams before cancelling them.
DRAIN_SECONDS = 10.0

Resolver = Callable[[str, int], list[str]]


def _resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Replica:
    # What the channel connects to: HOST:PORT, or IP:PORT of one resolved address.
    address: str
    # The name the address was resolved from; TLS checks the server's certificate against it
    # (certificates name the service, not each pod's IP). Empty when nothing was resolved.
    name: str = ""


def is_fanout(spec: str) -> bool:
    """Whether a --server value names several replicas: a list, or a `dns:` name to resolve."""
    return "," in spec or spec.startswith("dns:")


def parse_targets(spec: str, *, resolve: Resolver = _resolve) -> list[Replica]:
    """Replicas of `a:1,b:2` (one each) and of `dns:///name:port` (one per resolved address).

    Raises:
        ValueError: an empty list, a `dns:` entry without a port or that resolves to nothing.
    """
    replicas: list[Replica] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if not item.startswith("dns:"):
            replicas.append(Replica(address=item))
            continue
        # gRPC's form: dns:[//authority/]host:port; the authority (a DNS server) is not used.
        rest = item.removeprefix("dns:")
        if rest.startswith("//"):
            rest = rest[2:].partition("/")[2]
        host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"{item!r}: give the port, e.g. dns:///qmill-replicas:50051")
        host = host.strip("[]")
        try:
            addresses = resolve(host, int(port))
        except OSError as e:
            raise ValueError(f"{item!r}: cannot resolve {host} ({e})") from None
        if not addresses:
            raise ValueError(f"{item!r}: {host} resolves to no address")
        for address in addresses:
            shown = f"[{address}]" if ":" in address else address
            replicas.append(Replica(address=f"{shown}:{port}", name=host))
    if not replicas:
        raise ValueError(f"--server {spec!r} names no server")
    return list(dict.fromkeys(replicas))


def _connect(
    replica: Replica, timeout: float | None, creds: credentials_lib.Credentials
) -> client_lib.Client:
    """A Client to one replica; a resolved address checks the server's TLS certificate against
    the name it was resolved from."""
    # A channel of its own per stream: gRPC would otherwise share one subchannel (one TCP
    # connection, one sending thread's worth of throughput) among channels to the same target.
    options: list[tuple[str, Any]] = [("grpc.use_local_subchannel_pool", 1)]
    if replica.name and creds.tls:
        options.append(("grpc.ssl_target_name_override", replica.name))
    return client_lib.Client(replica.address, timeout=timeout, credentials=creds, options=options)


class _Lane:
    """One replica's share of a call: its client and what it holds."""

    def __init__(self, replica: Replica, client: client_lib.Client, number: int = 0) -> None:
        self.replica = replica
        # Which of the call's streams this is (0, 1, ...), over all replicas.
        self.number = number
        self.client = client
        # Tensors taken and not yet handed to the caller: path -> bytes.
        self.held: dict[str, int] = {}
        self.closed = False
        self.error: BaseException | None = None


class _Feed:
    """The call's tensors, handed to lanes one at a time; a failed lane's tensors come first."""

    def __init__(self, tensors: Iterator[tuple[str, np.ndarray]], depth: int, window: int):
        self._source = tensors
        self._depth = depth
        self._window = window
        self._cv = threading.Condition()
        self._read_lock = threading.Lock()  # one source read at a time, outside _cv
        self._exhausted = False
        self._again: collections.deque[tuple[str, np.ndarray]] = collections.deque()
        self._unanswered: dict[str, tuple[_Lane, np.ndarray]] = {}
        self.stopped = False
        self.source_error: BaseException | None = None
        self.resent = 0

    def _room(self, lane: _Lane) -> bool:
        held = lane.held
        return not held or (len(held) < self._depth and sum(held.values()) < self._window)

    def _done(self) -> bool:
        return self._exhausted and not self._again and not self._unanswered

    def complete(self) -> bool:
        with self._cv:
            return self._done()

    def tensors_for(self, lane: _Lane) -> Iterator[tuple[str, np.ndarray]]:
        """What `lane` sends; ends when everything is answered or the lane or call stops."""
        while (item := self._take(lane)) is not None:
            yield item

    def _take(self, lane: _Lane) -> tuple[str, np.ndarray] | None:
        while True:
            with self._cv:
                self._cv.wait_for(
                    lambda: (
                        self.stopped
                        or lane.closed
                        or self._done()
                        or (self._room(lane) and (self._again or not self._exhausted))
                    )
                )
                if self.stopped or lane.closed or self._done():
                    return None
                if self._again:
                    return self._hand(lane, self._again.popleft())
            # Only this lane's thread takes for it, so its room cannot shrink meanwhile.
            with self._read_lock:
                if self._exhausted:
                    continue
                try:
                    item = next(self._source)
                except StopIteration:
                    item = None
                except BaseException as e:  # a read error or the caller's cancel check
                    with self._cv:
                        self.source_error, self.stopped = e, True
                        self._cv.notify_all()
                    return None
                if item is None:
                    with self._cv:
                        self._exhausted = True
                        self._cv.notify_all()
                    continue
                with self._cv:
                    if lane.closed:  # the lane ended while reading: the next lane sends it
                        self._again.appendleft(item)
                        self._cv.notify_all()
                        return None
                    return self._hand(lane, item)

    def _hand(self, lane: _Lane, item: tuple[str, np.ndarray]) -> tuple[str, np.ndarray]:
        path, array = item
        self._unanswered[path] = (lane, array)
        lane.held[path] = array.nbytes
        return item

    def answered(self, path: str) -> None:
        with self._cv:
            self._unanswered.pop(path, None)
            self._cv.notify_all()

    def taken_by_caller(self, lane: _Lane, outcome: outcome_lib.TensorOutcome) -> None:
        with self._cv:
            lane.held.pop(outcome.path, None)
            self._cv.notify_all()

    def lane_ended(self, lane: _Lane) -> int:
        """Puts the lane's unanswered tensors back (first in line); returns how many."""
        with self._cv:
            lane.closed = True
            mine = [(p, a) for p, (owner, a) in self._unanswered.items() if owner is lane]
            for path, _ in mine:
                del self._unanswered[path]
            self._again.extendleft(reversed(mine))
            self.resent += len(mine)
            self._cv.notify_all()
            return len(mine)

    def stop(self) -> None:
        with self._cv:
            self.stopped = True
            self._cv.notify_all()


class FanoutClient:
    """Quantizes one stream of tensors on several replicas at once (see the module docstring).

    Example:
        with FanoutClient("10.0.0.1:50051,10.0.0.2:50051") as client:
            for outcome in client.quantize({"rules": [{"qtype": "int8"}]}, tensors):
                ...  # in completion order

    After a call, `answered_by` maps each path to the replica address that answered it
    (`answered_by_stream` to the number of the stream, 0 to replicas × streams - 1) and
    `lost` each dropped replica to its error; `resent` counts tensors sent again.
    """

    def __init__(
        self,
        targets: str | Sequence[str | Replica],
        *,
        timeout: float | None = None,
        credentials: credentials_lib.Credentials | None = None,
        tensors_per_replica: int = 4,
        streams: int = 1,
        on_replica_lost: Callable[[str, errors.QmillError], None] | None = None,
        resolve: Resolver = _resolve,
    ) -> None:
        """`targets`: a --server value (`a:1,b:2`, `dns:///name:port`) or a list of them;
        `streams`: concurrent QuantizeParams calls per replica."""
        items = [targets] if isinstance(targets, str) else list(targets)
        self.replicas: list[Replica] = []
        for item in items:
            self.replicas += (
                [item] if isinstance(item, Replica) else parse_targets(item, resolve=resolve)
            )
        if not self.replicas:
            raise ValueError("FanoutClient needs at least one replica")
        if tensors_per_replica < 1:
            raise ValueError(f"tensors_per_replica must be >= 1, got {tensors_per_replica}")
        if streams < 1:
            raise ValueError(f"--streams must be >= 1, got {streams}")
        self.streams = streams
        self.timeout = timeout
        self._credentials = credentials if credentials is not None else credentials_lib.default()
        self._depth = tensors_per_replica
        self._on_replica_lost = on_replica_lost
        self.answered_by: dict[str, str] = {}
        self.answered_by_stream: dict[str, int] = {}
        self.lost: dict[str, errors.QmillError] = {}
        self.resent = 0

    def __enter__(self) -> FanoutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release: each call opens and closes its own channels."""

    def quantize(
        self,
        recipe: recipes.Recipe,
        tensors: Iterable[tuple[str, np.ndarray]],
        *,
        window_bytes: int = streaming.DEFAULT_WINDOW_BYTES,
    ) -> Iterator[outcome_lib.TensorOutcome]:
        """Quantizes `tensors` (path, array) on all replicas; yields outcomes as they complete.

        `recipe`: a preset name, a TOML recipe file or a mapping. `window_bytes` bounds the
        tensor bytes in flight over all replicas together.

        Raises:
            errors.QmillError: a request error from any replica, or the last replica's error
                once every replica has failed.
        """
        recipe = recipes.load(recipe)  # read once, not by every replica's stream
        self.answered_by, self.lost, self.resent = {}, {}, 0
        self.answered_by_stream = {}
        streams = [r for r in self.replicas for _ in range(self.streams)]
        window = max(1, window_bytes // len(streams))
        feed = _Feed(iter(tensors), self._depth, window)
        events: queue.Queue[tuple[_Lane, outcome_lib.TensorOutcome | None]] = queue.Queue()
        lanes = [
            _Lane(r, _connect(r, self.timeout, self._credentials), i) for i, r in enumerate(streams)
        ]
        threads = [
            threading.Thread(
                target=self._run_lane,
                args=(lane, recipe, feed, events, window),
                name=f"qmill-fanout-{lane.number}-{lane.replica.address}",
                daemon=True,
            )
            for lane in lanes
        ]
        for thread in threads:
            thread.start()
        try:
            running = len(lanes)
            while running:
                lane, outcome = events.get()
                if outcome is not None:
                    feed.taken_by_caller(lane, outcome)
                    self.answered_by[outcome.path] = lane.replica.address
                    self.answered_by_stream[outcome.path] = lane.number
                    yield outcome
                    continue
                running -= 1
                self._lane_ended(lane, feed)
            self.resent = feed.resent
            if feed.source_error is not None:
                raise feed.source_error
            if not feed.complete():
                last = list(self.lost.values())[-1] if self.lost else None
                raise errors.QmillError(
                    "UNAVAILABLE",
                    f"all {len(self.replicas)} replicas failed"
                    + (f" ({len(lanes)} streams)" if self.streams > 1 else "")
                    + (f"; the last: {last.code}: {last.details}" if last else ""),
                )
        finally:
            # An early exit (an error, the caller stopping) ends the streams rather than
            # cancelling them: no more tensors, the servers answer what they hold and close.
            # Closing the channels, which cancels the calls, is the fallback after a while.
            feed.stop()
            deadline = time.monotonic() + DRAIN_SECONDS
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            for lane in lanes:
                lane.client.close()
            for thread in threads:
                thread.join(10)

    def _lane_ended(self, lane: _Lane, feed: _Feed) -> None:
        """Raises the lane's error if it is the request's fault; drops the replica otherwise."""
        error = lane.error
        if error is None:
            return
        if not isinstance(error, errors.QmillError) or error.code not in RETRY_ON_ANOTHER:
            feed.stop()
            raise error
        self.lost[lane.replica.address] = error
        if self._on_replica_lost is not None:
            self._on_replica_lost(lane.replica.address, error)

    @staticmethod
    def _run_lane(
        lane: _Lane,
        recipe: dict[str, Any],
        feed: _Feed,
        events: queue.Queue[tuple[_Lane, outcome_lib.TensorOutcome | None]],
        window: int,
    ) -> None:
        try:
            outcomes = lane.client.quantize(recipe, feed.tensors_for(lane), window_bytes=window)
            for outcome in outcomes:
                feed.answered(outcome.path)
                events.put((lane, outcome))
        except BaseException as e:  # handed to the caller's thread, which decides
            lane.error = e
        finally:
            feed.lane_ended(lane)
            events.put((lane, None))
