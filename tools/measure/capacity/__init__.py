"""The capacity search: the latency target (slo), the search over loads (search), its run on the sweep's worker (run), its statement and comparisons (report)."""
