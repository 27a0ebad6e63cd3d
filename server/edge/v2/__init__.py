"""The Open Inference Protocol (KServe V2, Triton's gRPC API) front end, and Triton's
system shared-memory extension of it (``shm``: the regions clients register, read and
written without grpc)."""
