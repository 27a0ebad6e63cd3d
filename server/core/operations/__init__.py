"""Operations: what the data plane can do with a model (embed; the reverse look-up next).
Each supplies validation into a job, its costs, its batch key, its compute and its
answer's shape; the scheduler is generic over them (``operations.base``)."""
