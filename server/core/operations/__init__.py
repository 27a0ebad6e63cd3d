"""Operations: what the data plane can do with a model (embed).
Each supplies validation into a job, its costs, its compute and its answer's shape; the
scheduler is generic over them (``operations.base``) and batches each one's jobs apart."""
