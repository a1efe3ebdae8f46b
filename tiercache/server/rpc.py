"""The RPC plumbing under every handler: authentication, timing and the one error-to-status path (`rpc`), and
request deserialization that turns malformed bytes into INVALID_ARGUMENT (`service_handler`, `Malformed`)."""

from __future__ import annotations

import functools
import inspect
import logging
import time

import grpc
from google.protobuf.message import Message

from tiercache.errors import InvalidArgument
from tiercache.protocol.wire import pb, status_for

log = logging.getLogger("tiercache.server")


def rpc(method):
    """Authenticate the caller, time the RPC, and map every error it raises to a status code in one place.

    The wrapped method receives the caller's Tenant as a third argument.
    """
    name = method.__name__
    streaming = inspect.isgeneratorfunction(method)

    def observe(self, started: float, code: grpc.StatusCode) -> None:
        self.metrics.rpc_seconds.labels(name, code.name).observe(time.perf_counter() - started)

    def fail(self, context, started: float, error: Exception) -> None:
        """End the RPC with the error's status: context.abort raises, so this is the handler's last statement."""
        code, message = status_for(error), str(error)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", name, exc_info=error)
            message = f"internal error in {name}"  # the details stay in the server's log
        observe(self, started, code)
        context.abort(code, message)

    if streaming:
        @functools.wraps(method)
        def stream_handler(self, request, context):
            started = time.perf_counter()
            try:
                tenant = self.tenants.authenticate(context.invocation_metadata())
                yield from method(self, _well_formed(request), context, tenant)
            except Exception as exc:  # noqa: BLE001 - every error becomes a status code
                fail(self, context, started, exc)
            else:
                observe(self, started, grpc.StatusCode.OK)
        return stream_handler

    @functools.wraps(method)
    def unary_handler(self, request, context):
        started = time.perf_counter()
        try:
            tenant = self.tenants.authenticate(context.invocation_metadata())
            response = method(self, _well_formed(request), context, tenant)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status code
            fail(self, context, started, exc)
        else:
            observe(self, started, grpc.StatusCode.OK)
            return response
    return unary_handler


def _well_formed(request):
    """The request, or InvalidArgument when its bytes did not decode; a request stream is checked frame by frame."""
    if isinstance(request, Malformed):
        request.reject()
    if isinstance(request, Message):
        return request
    return (frame.reject() if isinstance(frame, Malformed) else frame for frame in request)


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
