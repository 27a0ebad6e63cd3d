"""The exporter: a token-embedding module to a verified ONNX model directory.

This package's ``__init__`` imports nothing heavy on purpose: the server imports
``tokembed.export.model_dir`` (the loader) and must never pull in torch.
"""
