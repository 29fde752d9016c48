"""The shared core every layer may import and that imports nothing else of the project: the project root, text
clipping, the one failure type and its rendering, the parameter-model base, processes, Prometheus text, path
confinement and atomic output."""
