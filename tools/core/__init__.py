"""The shared core every layer may import and that imports nothing else of the project: the project root, text
clipping, the one failure type and its rendering, the parameter-model base, the progress callback (progress), the
UTC time as records and folder names write it (clock), the names that go into file names (names), processes,
Prometheus text, path confinement and atomic output."""
