"""What is served: a model directory checked and turned into its backend, and the built-in
default model."""
