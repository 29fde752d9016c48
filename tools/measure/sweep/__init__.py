"""The serving sweep: its parameters and results (params), its run (run), the benchmark worker process (worker), its evidence files and comparisons (report)."""
