"""Pure-PyTorch strict backend (CPU and CUDA): the reference implementation of the contract."""
