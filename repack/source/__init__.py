"""A source checkpoint folder, read safely: safetensors files through memory maps (safetensors_io), the folder's
config, shards and tensor table (checkpoint), and the checks before a build writes anything (checks: the source,
where the output goes, free disk)."""
