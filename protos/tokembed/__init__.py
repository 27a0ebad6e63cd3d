"""tokembed: the input-embedding layer of a Transformer, served over gRPC.

Sub-packages, one concern each: ``tokembed.export`` (torch module to a verified ONNX
model directory), ``tokembed.server`` (the batching gRPC server), ``tokembed.client``
(sync and asyncio clients), ``tokembed.v1`` (generated protocol code).
"""

__version__ = "0.1.0"
