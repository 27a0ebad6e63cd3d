"""How a model's look-ups are computed: the ``Backend`` interface and its two kinds, a
table of rows computed at load (``table``) and a run of the model (``onnxruntime``)."""
