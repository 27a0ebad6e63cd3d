"""The front ends: each protocol's translation between its wire and the data plane
(``v1``: tokembed.v1), and what the gRPC ones share: the status table, bearer tokens,
the checks before binding. Nothing below them imports grpc."""
