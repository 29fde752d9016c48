"""Google's QAT q4_0 Gemma 4 checkpoint to an all-4-bit compressed-tensors build (numpy, no torch).

The modules here are the commands (`python -m repack`, the article's three step scripts, `python -m
repack.tiny_model`) and what every folder shares (errors, choices, params); the folders, from the build down:
build/, then source/, schemes/ (with the report) and stand_ins/, then family/ and grid/ (pyproject.toml's
"the repack's floors" holds that order)."""
