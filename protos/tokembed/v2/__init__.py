"""Generated code for the Open Inference Protocol (KServe V2 / Triton gRPC) as tokembed serves
it; regenerate with scripts/gen_protos.py."""
