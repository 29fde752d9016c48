"""The symmetric 4-bit grid recovered from bf16 values (grid: the numpy reference and the dispatch), its numba
kernel (_kernel_numba) and the command that compiles the kernel into numba's cache ahead of use (kernel_cache,
`python -m repack.grid.kernel_cache`, which ./setup.sh runs)."""
