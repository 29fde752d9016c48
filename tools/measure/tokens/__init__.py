"""Greedy token identity between two builds: the record, check and live comparisons (compare), the long-context prompts (long_prompts)."""
