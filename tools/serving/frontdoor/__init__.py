"""The front door: vllm-router on the port clients use, the builds behind it as named instances, the switch from
one build to another, and every instance at once."""
