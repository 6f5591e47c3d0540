"""Triton kernels behind meshkern's ops (CUDA tensors; CPU under TRITON_INTERPRET=1).

Each module holds one op group's kernels and host wrappers; meshkern's ops call them
when the "triton" backend is chosen. Importing this package does not import triton.
"""
