"""The RPC plumbing under every handler: authentication, stream limits, timing and the one error-to-status path
(`rpc`), and request deserialization that turns malformed bytes into INVALID_ARGUMENT (`service_handler`,
`Malformed`). Handlers are coroutines on the server's event loop (grpc.aio)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time

import grpc
from google.protobuf.message import Message

from tiercache.errors import InvalidArgument
from tiercache.protocol.client_id import client_id_of
from tiercache.protocol.wire import ANSWERED_BY_SERVER, pb, status_for
from tiercache.server.auth import bearer_token

log = logging.getLogger("tiercache.server")


def rpc(method=None, *, stream: bool = False):
    """Authenticate the caller, time the RPC, and map every error it raises to a status code in one place.

    The wrapped coroutine receives the caller's Tenant (the intake's lookup of the call's bearer token) as a third
    argument. `stream=True` (Put, Get) also counts the call as a request in flight of its peer host and tenant
    (server.intake, server.limits) for as long as it runs.
    """
    if method is None:
        return functools.partial(rpc, stream=stream)
    name = method.__name__

    def observe(self, started: float, code: grpc.StatusCode) -> None:
        self.metrics.rpc_seconds.labels(name, code.name).observe(time.perf_counter() - started)

    @functools.wraps(method)
    async def handler(self, request, context):
        started = time.perf_counter()
        try:
            metadata = context.invocation_metadata()
            tenant = self.intake.tenant(bearer_token(metadata))
            with self.intake.in_flight(context.peer(), tenant, client_id_of(metadata)) if stream \
                    else contextlib.nullcontext():
                response = await method(self, _well_formed(request), context, tenant)
        except asyncio.CancelledError:  # the client went away (or the server is stopping): nobody to answer
            observe(self, started, grpc.StatusCode.CANCELLED)
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status code
            # A read or write on a call that already ended (the client cancelled, disconnected, or its deadline passed):
            # grpc raises its InternalError ("execute_batch" failed), sometimes before the call reads as cancelled.
            # Nobody is left to answer, and it is no server error.
            if context.cancelled() or isinstance(exc, grpc.aio.InternalError):
                log.debug("%s: the call ended under the handler: %s", name, exc)
                observe(self, started, grpc.StatusCode.CANCELLED)
                return None
            code, message = status_for(exc), str(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.error("%s failed", name, exc_info=exc)
                message = f"internal error in {name}"  # the details stay in the server's log
            observe(self, started, code)
            context.set_trailing_metadata(((ANSWERED_BY_SERVER, "1"),))
            await context.abort(code, message)  # raises: grpc ends the RPC with this status
        else:
            observe(self, started, grpc.StatusCode.OK)
            return response
    return handler


def _well_formed(request):
    """The request, or InvalidArgument when its bytes did not decode; a request stream is checked frame by frame."""
    if isinstance(request, Malformed):
        request.reject()
    if isinstance(request, Message):
        return request
    return _well_formed_frames(request)


async def _well_formed_frames(requests):
    async for frame in requests:
        if isinstance(frame, Malformed):
            frame.reject()
        yield frame


class Malformed:
    """A request whose bytes are not a valid message. The handler turns it into INVALID_ARGUMENT.

    (grpcio answers an exception in a deserializer with INTERNAL before any of our code runs; deserializing leniently
    and failing in the handler gives malformed input the status code it deserves, counted like any other error.)
    """

    def __init__(self, message_type: str, error: Exception) -> None:
        self.message_type = message_type
        self.error = error

    def reject(self) -> None:
        raise InvalidArgument(f"request is not a valid {self.message_type} message: {self.error}")


def _lenient(message_class):
    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, RuntimeWarning-as-error, ...: all malformed input
            return Malformed(message_class.DESCRIPTOR.name, exc)
    return deserialize


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler,
}


def service_handler(servicer) -> grpc.GenericRpcHandler:
    """The TierCache service's handlers, built from the proto descriptor like the generated code, but with lenient
    request deserializers (see Malformed)."""
    service = pb.DESCRIPTOR.services_by_name["TierCache"]
    handlers = {}
    for method in service.methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        kind = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(getattr(servicer, method.name), request_deserializer=_lenient(request_class),
                                     response_serializer=response_class.SerializeToString)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)
