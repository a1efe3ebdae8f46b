"""The pods' event streams: per pod a ZMQ PUB of KV-event batches in vLLM's wire format and a ROUTER that answers
replays with the pod's whole inventory (docs/events.md, "What is published"; tests/events/test_publisher.py).

- Live: three frames per batch, as vLLM's ZmqEventPublisher sends them: the topic `kv@<pod>@<model>` (llm-d reads the
  pod and the model from it), the batch's sequence number (8 bytes, big-endian, one per batch, consecutive from 0 in
  each incarnation of the stream), the msgpack payload (tiercache.events.vllm_wire). A pod's first batch is
  AllBlocksCleared and everything it can restore when it registers; after that, what changes, at most once per
  `flush_interval_s`; an empty batch after `heartbeat_s` of silence (Dynamo notices it must replay only on traffic).
- Replay: a request `[identity, b"", start_seq]` is answered with one frame for each seq from start_seq to the last
  one sent, S, as llm-d requires (consecutive, none missing): the first holds AllBlocksCleared and the pod's whole
  inventory as of S (a snapshot, not a ring of old batches: a subscriber that starts at 0 after a day of uptime gets
  exactly what is restorable now), the rest are empty; then the end marker (seq -1, empty payload). The ROUTER has no
  send limit (vLLM's high-water mark would drop frames of a long replay).

One thread owns every socket (ZMQ sockets are not thread-safe) and the index's flushes; pods are registered through
it. ZMQ has no authentication: the sockets listen on `events.host` only, which should face the pods alone.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import zmq

from tiercache.config import EventsConfig
from tiercache.events.blocks import AllBlocksCleared, Event, Pod
from tiercache.events.restorable import RestorableIndex
from tiercache.events.vllm_wire import batch_payload

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class Endpoints:
    """Where a router subscribes to a pod (`endpoint`) and asks it for replays (`replay_endpoint`)."""

    endpoint: str
    replay_endpoint: str
    topic: str


class _Stream:
    def __init__(self, context: zmq.Context, pod: Pod, host: str, ports: tuple[int, int] | None,
                 encoding: str = "map", ports_required: bool = True) -> None:
        """`ports`: (pub, replay) to bind, None: free ones. `ports_required=False`: free ones when those cannot
        be bound (ports a pod had before a restart, wished for on a server that hands out free ones)."""
        self.pod = pod
        self.encoding = encoding
        self.topic = f"kv@{pod.pod_id}@{pod.model_name}".encode()
        self.pub = context.socket(zmq.PUB)
        self.replay = context.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.SNDHWM, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        for sock in (self.pub, self.replay):
            sock.setsockopt(zmq.LINGER, 0)
        if ports is not None and not self._bind(host, ports, ports_required):
            ports = None
        if ports is None:
            pub_port = self.pub.bind_to_random_port(f"tcp://{host}")
            replay_port = self.replay.bind_to_random_port(f"tcp://{host}")
        else:
            pub_port, replay_port = ports
        self.endpoints = Endpoints(f"tcp://{host}:{pub_port}", f"tcp://{host}:{replay_port}", self.topic.decode())
        self.seq = -1  # the last seq sent
        self.sent_at = 0.0

    def _bind(self, host: str, ports: tuple[int, int], required: bool) -> bool:
        """Bind both sockets to `ports`; False (neither bound) when one is taken and they are not required."""
        bound = []
        try:
            for sock, port in zip((self.pub, self.replay), ports):
                sock.bind(f"tcp://{host}:{port}")
                bound.append((sock, port))
        except zmq.ZMQError:
            if required:
                raise
            for sock, port in bound:
                sock.unbind(f"tcp://{host}:{port}")
            return False
        return True

    def publish(self, events: list[Event]) -> None:
        self.seq += 1
        payload = batch_payload(events, self.pod.dp_rank, encoding=self.encoding)
        self.pub.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload))
        self.sent_at = time.monotonic()

    def answer(self, request: list[bytes], snapshot: list[Event]) -> None:
        if len(request) != 3 or len(request[2]) != 8:
            log.warning("kv events: malformed replay request on %s", self.endpoints.replay_endpoint)
            return
        identity, start = request[0], int.from_bytes(request[2], "big")
        for seq in range(start, self.seq + 1):
            events = snapshot if seq == start else []
            payload = batch_payload(events, self.pod.dp_rank, encoding=self.encoding)
            self.replay.send_multipart((identity, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self.pub.close()
        self.replay.close()


class EventStreams:
    def __init__(self, index: RestorableIndex, config: EventsConfig) -> None:
        self._index = index
        self._config = config
        self._context = zmq.Context()
        self._streams: dict[str, _Stream] = {}
        self._commands: queue.Queue = queue.Queue()
        # With base_port, pod slots: slot i is PUB base_port + 2i and ROUTER base_port + 2i + 1. A new pod takes the
        # next slot never given; a pod registering again after a server restart asks for the one it had.
        self._slots: dict[str, int] = {}
        self._next_slot = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiercache-kv-events", daemon=True)
        self._thread.start()

    def register(self, pod: Pod, timeout_s: float = 30.0, ports: tuple[int, int] | None = None) -> Endpoints:
        """Start (or restart) the pod's stream; its endpoints. A pod registered again keeps its sockets and its
        sequence, and its next batch starts over with AllBlocksCleared (the engine behind it restarted). `ports`:
        the (pub, replay) ports a new stream should have if it can (what the pod was answered before this server
        restarted): with base_port, when they are a slot of its range that no pod holds; without, when they are
        free. Otherwise the pod gets ports as any new pod does."""
        return self._ask(("register", (pod, ports)), timeout_s)

    def unregister(self, pod_id: str, timeout_s: float = 30.0) -> None:
        """End the pod's stream: a last AllBlocksCleared, then its sockets close."""
        self._ask(("unregister", pod_id), timeout_s)

    @property
    def index(self) -> RestorableIndex:
        """The restorable index behind the streams (its reads take its own lock: callable from any thread)."""
        return self._index

    def registered(self, pod_id: str) -> bool:
        """Whether the pod has a stream (callable from any thread: one read of a dict)."""
        return pod_id in self._streams

    def endpoints(self) -> dict[str, Endpoints]:
        return {pod_id: stream.endpoints for pod_id, stream in list(self._streams.items())}

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=10)
        for stream in self._streams.values():
            stream.close()
        self._context.term()

    def _ask(self, command, timeout_s: float):
        if self._stopping.is_set():
            raise RuntimeError("the kv event streams are closed")
        answer: Future = Future()
        self._commands.put((command, answer))
        return answer.result(timeout=timeout_s)

    # -- the thread ---------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        interval_ms = max(1, int(self._config.flush_interval_s * 1000))
        next_flush = time.monotonic()
        while not self._stopping.is_set():
            try:
                self._obey(poller)
                # Rounded up: a wait rounded down to 0 ms polls again at once, until the flush is due.
                wait_ms = min(interval_ms, math.ceil(max(0.0, next_flush - time.monotonic()) * 1000))
                ready = self._wait(poller, wait_ms)
                for stream in list(self._streams.values()):
                    if stream.replay in ready:
                        stream.answer(stream.replay.recv_multipart(), self._index.snapshot(stream.pod.pod_id))
                if time.monotonic() >= next_flush:
                    next_flush = time.monotonic() + self._config.flush_interval_s
                    self._flush()
            except Exception:  # noqa: BLE001 - the streams outlive any one failure; a router replays what it missed
                log.exception("kv events: a flush or replay failed")
                time.sleep(self._config.flush_interval_s)

    def _wait(self, poller: zmq.Poller, wait_ms: int) -> dict:
        """The replay sockets that have a request, after at most `wait_ms`. With no pod registered there is nothing
        to poll, and zmq's poll returns at once: this thread would spin, holding the interpreter's lock in every
        round (a server with events and no engine yet burned a core, and starved an in-process engine's thread)."""
        if poller.sockets:
            return dict(poller.poll(wait_ms))
        self._stopping.wait(wait_ms / 1000)
        return {}

    def _flush(self) -> None:
        for pod_id, events in self._index.flush().items():
            stream = self._streams.get(pod_id)
            if stream is not None:
                stream.publish(events)
        now = time.monotonic()
        for stream in self._streams.values():
            if now - stream.sent_at >= self._config.heartbeat_s:
                stream.publish([])

    def _obey(self, poller: zmq.Poller) -> None:
        while True:
            try:
                (verb, argument), answer = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                if verb == "register":
                    answer.set_result(self._register(*argument, poller))
                else:
                    answer.set_result(self._unregister(argument, poller))
            except Exception as exc:  # noqa: BLE001 - the caller's to report
                answer.set_exception(exc)

    def _register(self, pod: Pod, wanted: tuple[int, int] | None, poller: zmq.Poller) -> Endpoints:
        self._flush()  # what changed before the pod (re)starts goes out under the old registration
        stream = self._streams.get(pod.pod_id)
        if stream is None:
            base = self._config.base_port
            if base:
                slot = self._slot(pod.pod_id, wanted)
                ports, required = (base + 2 * slot, base + 2 * slot + 1), True
            else:
                ports, required = wanted, False
            stream = _Stream(self._context, pod, self._config.host, ports, self._config.encoding, required)
            self._streams[pod.pod_id] = stream
            poller.register(stream.replay, zmq.POLLIN)
        stream.pod = pod
        stream.publish(self._index.add_pod(pod))
        return stream.endpoints

    def _slot(self, pod_id: str, wanted: tuple[int, int] | None) -> int:
        """The base_port slot of a new stream: the one `wanted` names when it is a slot no other pod holds, else the
        next one never given (above every slot given: a slot a pod left is not handed to a new pod, as routers may
        still point at it for the old one)."""
        held = {slot for pod, slot in self._slots.items() if pod != pod_id}
        offset = wanted[0] - self._config.base_port if wanted else -1
        if wanted and offset >= 0 and offset % 2 == 0 and wanted[1] == wanted[0] + 1 and offset // 2 not in held:
            slot = offset // 2
        else:
            slot = self._next_slot
        self._next_slot = max(self._next_slot, slot + 1)
        self._slots[pod_id] = slot
        return slot

    def _unregister(self, pod_id: str, poller: zmq.Poller) -> None:
        self._index.remove_pod(pod_id)
        self._slots.pop(pod_id, None)
        stream = self._streams.pop(pod_id, None)
        if stream is not None:
            stream.publish([AllBlocksCleared()])
            poller.unregister(stream.replay)
            stream.close()
