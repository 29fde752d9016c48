"""A build, from paper to disk: whether a member fits one T4 (fit, `python -m repack plan`), which tensors sit on
the grid (probe), what each table will weigh (preview), what happens to each tensor (plan) and the one pass that
writes the build (build)."""
