"""How a model's look-ups are computed: the ``Backend`` interface (``base``) and its
backends: a table of rows computed at load (``table``; ``segment`` for a segment model's
table of every id and type) and a run of the model per batch (``runtime``, over the
onnxruntime sessions of ``sessions``)."""
