"""Kernels: PyTorch references (speculative.py, rows.py), their Triton twins (triton_*.py), and
kernels.dispatch, which picks one per call (Triton on CUDA when it imports; TANDEM_KERNELS forces)."""
