"""The Turing clamp on vLLM's Triton unified attention (Tesla T4): where the tile size is decided, and the patch."""
