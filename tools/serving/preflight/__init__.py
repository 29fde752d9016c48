"""Everything checked before a server starts: the machine, the model folder, the installed versions, the
speculative config, swap; each check `ok|warn|fail|n/a` with one line on how to fix it."""
