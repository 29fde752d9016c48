"""Google's QAT q4_0 Gemma 4 checkpoint to an all-4-bit compressed-tensors build (numpy, no torch)."""
