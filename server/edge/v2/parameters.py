"""A request's or an output's ``parameters`` read by name (the Open Inference Protocol's
``InferParameter``), each of the type it must have: a parameter of another type is refused
by its name."""

from __future__ import annotations

from collections.abc import Mapping

from tokembed.server.core.errors import InvalidInput
from tokembed.v2 import grpc_service_pb2 as pb


def string_parameter(parameters: Mapping[str, pb.InferParameter], name: str) -> str:
    """``name``'s string, or "" when it is not given."""
    if name not in parameters:
        return ""
    parameter = parameters[name]
    if parameter.WhichOneof("parameter_choice") != "string_param":
        raise InvalidInput(f"parameter {name} must be a string")
    return str(parameter.string_param)


def bool_parameter(
    parameters: Mapping[str, pb.InferParameter], name: str, default: bool = False
) -> bool:
    """``name``'s boolean, or ``default`` when it is not given."""
    if name not in parameters:
        return default
    parameter = parameters[name]
    if parameter.WhichOneof("parameter_choice") != "bool_param":
        raise InvalidInput(f"parameter {name} must be a bool")
    return bool(parameter.bool_param)
