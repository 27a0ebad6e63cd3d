"""The Open Inference Protocol (KServe V2, Triton's gRPC API) front end."""
