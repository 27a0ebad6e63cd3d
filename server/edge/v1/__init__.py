"""The tokembed.v1 front end: the EmbeddingService's RPCs, translated to and from the data
plane (``servicer``), its request parsing (``requests``) and its hand-encoded answers
(``responses``)."""
