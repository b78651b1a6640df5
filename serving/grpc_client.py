"""The Open Inference Protocol's gRPC half from the client side: ``attnzoo predict --grpc HOST:PORT``.

    from serving.grpc_client import GrpcClient
    c = GrpcClient("127.0.0.1:8081")
    c.translate("bahdanau", ["Wo ist der Bahnhof?"])[0]["translation"]

:class:`GrpcClient` answers the same calls as :class:`serving.client.Client` (metadata, infer,
translate) with the same arrays: inputs travel in ``raw_input_contents`` (what production clients
such as tritonclient.grpc send) and answers come back in ``raw_output_contents``. A gRPC error is a
:class:`GrpcError` whose ``status`` is the HTTP status the REST server gives the same request, so
callers handle both protocols alike. Needs grpcio (the ``serve`` extra), never torch.
"""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np

from serving.client import Client, ServerError, as_tensor
from serving.grpc import grpc_service_pb2 as pb
from serving.protocol import DATATYPES, tensor_from_bytes, tensor_to_bytes

SERVICE = "/inference.GRPCInferenceService/"
C = grpc.StatusCode
# gRPC code -> the HTTP status the REST server answers for the same error (serving.grpc_server.CODES
# read backwards; INVALID_ARGUMENT also stands for 413 and 415, which gRPC does not tell apart).
HTTP = {C.INVALID_ARGUMENT: 400, C.NOT_FOUND: 404, C.FAILED_PRECONDITION: 409, C.RESOURCE_EXHAUSTED: 413,
        C.UNAVAILABLE: 503, C.DEADLINE_EXCEEDED: 504, C.UNIMPLEMENTED: 501, C.CANCELLED: 499}


class GrpcError(ServerError):
    """A gRPC error, with the HTTP ``status`` REST answers for it (0: the server was not reached)."""

    def __init__(self, status: int, code: grpc.StatusCode, message: str):
        RuntimeError.__init__(self, f"gRPC {code.name}: {message}")
        self.status, self.code = status, code


def _param(value: Any) -> pb.InferParameter:
    """A request parameter as the protocol's typed InferParameter."""
    if isinstance(value, bool):
        return pb.InferParameter(bool_param=value)
    if isinstance(value, int):
        return pb.InferParameter(int64_param=value)
    if isinstance(value, float):
        return pb.InferParameter(double_param=value)
    return pb.InferParameter(string_param=str(value))


def _array(tensor, raw: bytes) -> np.ndarray:
    """An output's raw contents -> the array :func:`serving.client.decode` gives for it over REST."""
    if tensor.datatype == "BYTES":
        return tensor_from_bytes(tensor.name, "BYTES", list(tensor.shape), raw)
    wire = np.dtype(DATATYPES[tensor.datatype]).newbyteorder("<")
    return np.frombuffer(raw, wire).astype(DATATYPES[tensor.datatype]).reshape(list(tensor.shape))


class GrpcClient(Client):
    """``target``: ``HOST:PORT`` of ``attnzoo serve --grpc-port PORT`` (or any v2 gRPC server)."""

    def __init__(self, target: str = "127.0.0.1:8081", timeout: float = 60.0):
        self.target, self.timeout = target.removeprefix("grpc://"), timeout
        self.url = f"grpc://{self.target}"
        self.channel = grpc.insecure_channel(self.target, options=[("grpc.max_receive_message_length", -1),
                                                                   ("grpc.max_send_message_length", -1)])

    def close(self) -> None:
        self.channel.close()

    def rpc(self, method: str, request, response_type):
        """One unary call within ``timeout`` seconds; errors as :class:`GrpcError`."""
        call = self.channel.unary_unary(SERVICE + method, request_serializer=lambda m: m.SerializeToString(),
                                        response_deserializer=response_type.FromString)
        try:
            return call(request, timeout=self.timeout)
        except grpc.RpcError as err:
            code, details = err.code(), err.details() or ""
            if code == C.UNAVAILABLE and ("connect" in details.lower() or "refused" in details.lower()):
                raise GrpcError(0, code, f"cannot reach {self.target} ({details}); is `attnzoo serve --grpc-port` "
                                         "running there?") from None
            raise GrpcError(HTTP.get(code, 500), code, details) from None

    def server_metadata(self) -> dict:
        meta = self.rpc("ServerMetadata", pb.ServerMetadataRequest(), pb.ServerMetadataResponse)
        return {"name": meta.name, "version": meta.version, "extensions": list(meta.extensions)}

    def ready(self) -> bool:
        try:
            return self.rpc("ServerReady", pb.ServerReadyRequest(), pb.ServerReadyResponse).ready
        except ServerError:
            return False

    def model_metadata(self, name: str, version: str | int | None = None) -> dict:
        meta = self.rpc("ModelMetadata", pb.ModelMetadataRequest(name=name, version=str(version or "")),
                        pb.ModelMetadataResponse)
        tensors = {key: [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                         for t in getattr(meta, key)] for key in ("inputs", "outputs")}
        return {"name": meta.name, "versions": list(meta.versions), "platform": meta.platform, **tensors}

    def infer(self, name: str, inputs: dict[str, Any], version: str | int | None = None,
              outputs: list[str] | None = None, parameters: dict | None = None,
              request_id: str | None = None, binary: bool = True) -> dict[str, np.ndarray]:
        """As :meth:`Client.infer`; the tensors always travel raw (``binary`` is accepted and ignored)."""
        request = pb.ModelInferRequest(model_name=name, model_version=str(version or ""), id=request_id or "")
        for key, value in (parameters or {}).items():
            request.parameters[key].CopyFrom(_param(value))
        for input_name, value in inputs.items():
            array, datatype = as_tensor(value)
            request.inputs.add(name=input_name, datatype=datatype, shape=list(array.shape))
            request.raw_input_contents.append(tensor_to_bytes(array, datatype))
        for output_name in outputs or []:
            request.outputs.add(name=output_name)
        response = self.rpc("ModelInfer", request, pb.ModelInferResponse)
        return {t.name: _array(t, raw) for t, raw in zip(response.outputs, response.raw_output_contents)}
