"""Sources made here, so that nothing has to be downloaded: the tiny Gemma-4-shaped model the tests and the demo
serve (tiny_model, its shapes in tiny_shapes, the mark of a folder it wrote in tiny_marker; its command line is
repack/tiny_model.py) and numpy-made checkpoints at a member's real shapes or with hand-made faults (synthetic)."""
