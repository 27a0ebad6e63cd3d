"""Errors of the exporter and of the model-directory loader.

Each message is one line a user can act on; the command line prints it as is.
"""


class ExportError(Exception):
    """The export cannot go on: bad arguments, unusable checkpoint, parity failure."""


class CheckpointError(ExportError):
    """The checkpoint file is missing, unreadable, or has no usable matrix at the key."""


class ParityError(ExportError):
    """The ONNX model does not compute what the torch module computes."""


class ModelDirError(Exception):
    """A model directory is invalid; the message names exactly what is wrong."""
