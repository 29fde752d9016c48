"""Task evals through lm-evaluation-harness: the task checks (tasks), parameter and result models (results), the run (run), two runs compared (compare)."""
