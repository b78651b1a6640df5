"""The Open Inference Protocol's gRPC half (``inference.GRPCInferenceService``) beside the REST server.

``attnzoo serve --grpc-port N`` starts it on the REST server's event loop (a FastAPI lifespan), so
both protocols share one :class:`serving.server.Service`: the same models, admission, batchers
(a gRPC and a REST request can share a step batch), limits, deadlines and metrics. A gRPC request
is turned into the REST request it stands for (its tensors as binary tensor data) and checked by
serving.protocol, so its errors are the same sentences; their HTTP statuses map to gRPC codes as
Triton maps its errors (:data:`CODES`). Methods: ServerLive, ServerReady, ModelReady, ServerMetadata,
ModelMetadata, ModelInfer (typed contents or raw_input_contents; answers in raw_output_contents,
as Triton does) and Triton's RepositoryIndex, RepositoryModelLoad and RepositoryModelUnload
(``--model-control explicit``); the others answer UNIMPLEMENTED.

The message classes are generated from serving/grpc/grpc_service.proto and shipped (see that file).
Requests arrive as bytes and are parsed here: a message that is not one is INVALID_ARGUMENT, where
grpcio's own deserializer would answer INTERNAL.
"""

from __future__ import annotations

import asyncio
import logging
import math
from contextlib import asynccontextmanager

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from grpc import aio

from serving import __version__
from serving.base import ServedModel
from serving.grpc import grpc_service_pb2 as pb
from serving.protocol import (
    DATATYPES,
    MAX_DIMS,
    MAX_ELEMENTS,
    RequestError,
    declared_shapes,
    parse_request,
    tensor_to_bytes,
)

log = logging.getLogger("attnzoo.serving.grpc")
SERVICE = "inference.GRPCInferenceService"
C = grpc.StatusCode
# HTTP status of a RequestError -> gRPC code. Triton answers its invalid-argument errors (a model's
# limits among them) INVALID_ARGUMENT, unknown models NOT_FOUND, a full server UNAVAILABLE; grpcio
# itself answers a message over --max-body-mb RESOURCE_EXHAUSTED and a passed deadline DEADLINE_EXCEEDED.
CODES = {400: C.INVALID_ARGUMENT, 404: C.NOT_FOUND, 408: C.DEADLINE_EXCEEDED, 409: C.FAILED_PRECONDITION,
         413: C.INVALID_ARGUMENT, 415: C.INVALID_ARGUMENT, 503: C.UNAVAILABLE, 504: C.DEADLINE_EXCEEDED}
MAX_MESSAGE = 500  # characters of an error message, as over REST
# datatype -> the InferTensorContents field its typed values travel in (FP16: raw contents only)
FIELDS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
          "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
          "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def _param(value: pb.InferParameter):
    which = value.WhichOneof("parameter_choice")
    return None if which is None else getattr(value, which)


def _params(parameters) -> dict:
    return {k: _param(v) for k, v in parameters.items()}


def _valid_shape(shape: list[int]) -> bool:
    return (len(shape) <= MAX_DIMS and all(0 <= d <= MAX_ELEMENTS for d in shape)
            and math.prod(shape) <= MAX_ELEMENTS)


def _typed_bytes(tensor) -> bytes:
    """An input's typed contents as binary tensor data (little-endian, row-major), checked against
    its datatype: the field its values must be in, their count, their range."""
    name, datatype, shape = tensor.name, tensor.datatype, list(tensor.shape)
    given = [f.name for f, _ in tensor.contents.ListFields()]
    field = FIELDS.get(datatype)
    if field is None:  # an unknown datatype is reported by serving.protocol, by the same sentence as over REST
        if given and datatype in DATATYPES:
            raise RequestError(f"input '{name}': {datatype} values travel only in raw_input_contents")
        return b""
    wrong = [g for g in given if g != field]
    if wrong:
        raise RequestError(f"input '{name}': {datatype} values go in contents.{field}, got contents.{wrong[0]}")
    values = getattr(tensor.contents, field)
    if _valid_shape(shape) and len(values) != math.prod(shape):
        raise RequestError(f"input '{name}': shape {shape} needs {math.prod(shape)} values, got {len(values)} "
                           f"in contents.{field}")
    if datatype == "BYTES":
        return b"".join(len(v).to_bytes(4, "little") + v for v in values)
    array = np.array(values, dtype=np.bool_ if datatype == "BOOL" else None)
    if datatype.startswith(("INT", "UINT")) and array.size:
        info = np.iinfo(DATATYPES[datatype])
        if array.min() < info.min or array.max() > info.max:
            raise RequestError(f"input '{name}': a value is out of range for {datatype}")
    return tensor_to_bytes(array.astype(DATATYPES[datatype]) if array.size else np.zeros(0, DATATYPES[datatype]),
                           datatype)


def as_rest(request: pb.ModelInferRequest) -> tuple[dict, dict[str, bytes]]:
    """A ModelInferRequest -> the REST request it stands for (the JSON, each input's binary data):
    every input as binary tensor data, from raw_input_contents or from its typed contents."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise RequestError(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} input(s); give one "
                           "per input, in the order of inputs (or none and typed contents)")
    tensors, binary = [], {}
    for i, tensor in enumerate(request.inputs):
        if raw and tensor.HasField("contents"):
            raise RequestError(f"input '{tensor.name}': give its values in raw_input_contents or in contents, not both")
        data = raw[i] if raw else _typed_bytes(tensor)
        shape, datatype = list(tensor.shape), tensor.datatype
        size = np.dtype(DATATYPES[datatype]).itemsize if datatype in DATATYPES and datatype != "BYTES" else None
        if raw and size and _valid_shape(shape) and len(data) != math.prod(shape) * size:
            raise RequestError(f"input '{tensor.name}': shape {shape} of {datatype} takes {math.prod(shape) * size} "
                               f"bytes ({math.prod(shape)} x {size}), but its raw_input_contents has {len(data)}")
        if tensor.name in binary:
            raise RequestError(f"input '{tensor.name}' given twice")
        binary[tensor.name] = data
        params = {**_params(tensor.parameters), "binary_data_size": len(data)}
        tensors.append({"name": tensor.name, "shape": shape, "datatype": datatype, "parameters": params})
    body = {"inputs": tensors, "parameters": _params(request.parameters)}
    if request.id:
        body["id"] = request.id
    if request.outputs:
        body["outputs"] = [{"name": o.name, "parameters": _params(o.parameters)} for o in request.outputs]
    return body, binary


def parse(model: ServedModel, request: pb.ModelInferRequest) -> tuple:
    """(feeds, wanted outputs, parameters, id): checked as a REST request is, the model's limits on
    the declared shapes first."""
    body, binary = as_rest(request)
    model.check_limits(declared_shapes(body, model.inputs), body["parameters"])
    feeds, wanted, params = parse_request(body, model.inputs, model.outputs, binary)
    return feeds, wanted, params, request.id


def encode(model: ServedModel, outputs: list, request_id: str) -> pb.ModelInferResponse:
    """The answer (its size already checked against the model's limit by ``Service.handle``)."""
    response = pb.ModelInferResponse(model_name=model.name, model_version=str(model.version), id=request_id)
    for name, array, datatype in outputs:
        array = np.asarray(array)
        response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        response.raw_output_contents.append(tensor_to_bytes(array, datatype))
    return response


class Handlers:
    """The service's methods over one :class:`serving.server.Service`."""

    def __init__(self, service):
        self.service = service

    def server_live(self, _request, _context):
        return pb.ServerLiveResponse(live=True)

    def server_ready(self, _request, _context):
        repo = self.service.repo
        return pb.ServerReadyResponse(ready=bool(repo.models) and not repo.errors)

    def model_ready(self, request, _context):
        return pb.ModelReadyResponse(ready=self.service.model_ready(request.name, request.version or None)["ready"])

    def server_metadata(self, _request, _context):
        return pb.ServerMetadataResponse(name="attnzoo", version=__version__,
                                         extensions=["binary_tensor_data", "model_repository"])

    def model_metadata(self, request, _context):
        meta = self.service.metadata(request.name, request.version or None)
        tensors = {key: [pb.ModelMetadataResponse.TensorMetadata(name=t["name"], datatype=t["datatype"],
                                                                 shape=t["shape"]) for t in meta[key]]
                   for key in ("inputs", "outputs")}
        return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                        **tensors)

    def repository_index(self, request, _context):
        """Every version's state and reason, as over REST (``ready``: the READY ones only)."""
        return pb.RepositoryIndexResponse(models=[
            pb.RepositoryIndexResponse.ModelIndex(name=e["name"], version=e["version"], state=e["state"],
                                                  reason=e.get("reason", ""))
            for e in self.service.repo.index(ready_only=request.ready)])

    async def model_load(self, request, _context):
        """As ``POST /v2/repository/models/{name}/load``: the same checks, sentences and statuses."""
        await self.service.control("load", request.model_name, dict(request.parameters))
        return pb.RepositoryModelLoadResponse()

    async def model_unload(self, request, _context):
        await self.service.control("unload", request.model_name, dict(request.parameters))
        return pb.RepositoryModelUnloadResponse()

    async def model_infer(self, request, context):
        """Within the service's --timeout-s and the call's own deadline, whichever comes first."""
        remaining = context.time_remaining()
        timeout_s = self.service.cfg.timeout_s
        if remaining is not None and remaining < timeout_s:
            timeout_s = round(max(remaining, 0.001), 3)
        return await self.service.handle(request.model_name, request.model_version or None, "grpc", timeout_s,
                                         lambda model: parse(model, request),
                                         lambda model, outputs, request_id: encode(model, outputs, request_id))


METHODS = {  # method -> (request message, handler name)
    "ServerLive": (pb.ServerLiveRequest, "server_live"), "ServerReady": (pb.ServerReadyRequest, "server_ready"),
    "ModelReady": (pb.ModelReadyRequest, "model_ready"),
    "ServerMetadata": (pb.ServerMetadataRequest, "server_metadata"),
    "ModelMetadata": (pb.ModelMetadataRequest, "model_metadata"), "ModelInfer": (pb.ModelInferRequest, "model_infer"),
    "RepositoryIndex": (pb.RepositoryIndexRequest, "repository_index"),
    "RepositoryModelLoad": (pb.RepositoryModelLoadRequest, "model_load"),
    "RepositoryModelUnload": (pb.RepositoryModelUnloadRequest, "model_unload"),
}


def _short(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."


def _method(message_type, handler):
    """A unary method taking the request's bytes: a message that does not parse, and every
    RequestError, answer their gRPC code and sentence."""
    async def method(raw: bytes, context: aio.ServicerContext):
        try:
            request = message_type.FromString(raw)
        except DecodeError:
            request = None
        if request is None:
            await context.abort(C.INVALID_ARGUMENT, f"the request is not a valid {message_type.DESCRIPTOR.full_name} "
                                                    "message; send one as grpc_service.proto defines it")
        try:
            answer = handler(request, context)
            return await answer if asyncio.iscoroutine(answer) else answer
        except RequestError as err:
            error = err
        await context.abort(CODES.get(error.status, C.INTERNAL), _short(str(error)))

    return grpc.unary_unary_rpc_method_handler(method, response_serializer=lambda m: m.SerializeToString())


def create_server(service) -> aio.Server:
    """The gRPC server of ``service`` (not started), bound to --host and --grpc-port."""
    cfg, handlers = service.cfg, Handlers(service)
    server = aio.server(
        # grpcio answers RESOURCE_EXHAUSTED to a larger message, and to calls beyond --max-connections
        options=[("grpc.max_receive_message_length", int(cfg.max_body_mb * 2**20)),
                 ("grpc.max_send_message_length", -1)],
        maximum_concurrent_rpcs=cfg.max_connections)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        name: _method(message_type, getattr(handlers, attr)) for name, (message_type, attr) in METHODS.items()}),))
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    if server.add_insecure_port(f"{host}:{cfg.grpc_port}") == 0:
        raise RuntimeError(f"cannot bind the gRPC port {host}:{cfg.grpc_port}; choose another with --grpc-port")
    return server


def grpc_lifespan(service):
    """A FastAPI lifespan serving gRPC on the REST server's event loop while the app runs."""
    @asynccontextmanager
    async def lifespan(_app):
        server = create_server(service)
        await server.start()
        log.info("gRPC (GRPCInferenceService) on %s:%d", service.cfg.host, service.cfg.grpc_port)
        try:
            yield
        finally:
            await server.stop(grace=1)

    return lifespan
