"""Quantized checkpoints: the compressed-tensors config, one scheme object per format, the
offline quantizer."""
