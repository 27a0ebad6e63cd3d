"""The gRPC edge: parse requests into the core's types, call the model's engine, encode
its answer, map domain errors to status codes. It holds no memory or look-up policy."""
