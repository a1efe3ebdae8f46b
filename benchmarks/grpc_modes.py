"""grpcio's ceiling for bulk bytes on this machine: sync vs aio servers, protobuf vs raw-bytes frames.

The remote data path streams chunks in 1 MiB frames; this measures what grpcio itself can move, without tiercache,
for 4 MiB chunks (4 frames per call) and 64 MiB streams (64 frames per call), so the choice of server mode is made
with numbers (docs/performance.md).

    .venv/bin/python -m benchmarks.grpc_modes [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from concurrent import futures

import grpc

FRAME = 1 << 20
DATA = bytes(range(256)) * (FRAME // 256)
TOTAL_FRAMES = 128
_IDENT = lambda b: b  # noqa: E731


def _handlers(is_async: bool):
    if is_async:
        async def put(it, ctx):
            n = 0
            async for frame in it:
                n += len(frame)
            return b"%d" % n

        async def get(req, ctx):
            for _ in range(int(req)):
                yield DATA
    else:
        def put(it, ctx):
            return b"%d" % sum(len(frame) for frame in it)

        def get(req, ctx):
            for _ in range(int(req)):
                yield DATA
    return grpc.method_handlers_generic_handler("bench.Bulk", {
        "Put": grpc.stream_unary_rpc_method_handler(put, _IDENT, _IDENT),
        "Get": grpc.unary_stream_rpc_method_handler(get, _IDENT, _IDENT)})


def sync_client(port: int, frames_per_call: int) -> tuple[float, float]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        put = channel.stream_unary("/bench.Bulk/Put", request_serializer=_IDENT, response_deserializer=_IDENT)
        get = channel.unary_stream("/bench.Bulk/Get", request_serializer=_IDENT, response_deserializer=_IDENT)
        calls = TOTAL_FRAMES // frames_per_call
        started = time.perf_counter()
        for _ in range(calls):
            put(iter([DATA] * frames_per_call))
        middle = time.perf_counter()
        for _ in range(calls):
            for _ in get(b"%d" % frames_per_call):
                pass
        ended = time.perf_counter()
    total = TOTAL_FRAMES * FRAME
    return total / (middle - started) / 1e9, total / (ended - middle) / 1e9


def measure(is_async: bool, frames_per_call: int) -> tuple[float, float]:
    if not is_async:
        server = grpc.server(futures.ThreadPoolExecutor(8), handlers=[_handlers(False)])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            return sync_client(port, frames_per_call)
        finally:
            server.stop(0)

    async def run() -> tuple[float, float]:
        server = grpc.aio.server(handlers=[_handlers(True)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await asyncio.to_thread(sync_client, port, frames_per_call)
        finally:
            await server.stop(0)
    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{'server':<6}{'frames/call':>12}{'put GB/s':>10}{'get GB/s':>10}   (raw-bytes frames, sync client)")
    for is_async in (False, True):
        for frames in (4, 64):
            results = [measure(is_async, frames) for _ in range(args.rounds)]
            put = statistics.median(r[0] for r in results)
            get = statistics.median(r[1] for r in results)
            print(f"{'aio' if is_async else 'sync':<6}{frames:>12}{put:>10.2f}{get:>10.2f}")


if __name__ == "__main__":
    main()
