"""The CUDA sources of tiercache.kernels (`*.cu`), read as package data and compiled with CuPy on first use."""
