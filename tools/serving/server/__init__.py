"""One vLLM server's whole life: checked, launched, ready, its status, queries and log, stopped; its results."""
