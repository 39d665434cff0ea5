"""`dsq eval`: how far a quantized model is from its source, on held-out text."""
