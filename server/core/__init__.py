"""The request path with no transport in sight: the data plane (every protocol's
requests), the repository of model versions, operations, the scheduler (admission,
placement, the batcher), dtypes, types and errors.

Nothing here imports grpc; the front ends (``tokembed.server.edge``) translate into it.
"""
