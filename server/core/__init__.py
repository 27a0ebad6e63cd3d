"""The request path with no transport in sight: types, errors, validation, admission,
the look-up policy, the batcher, one engine per model and the registry of engines.

Nothing here imports grpc; the protocols (``tokembed.server.edge``) translate into it.
"""
