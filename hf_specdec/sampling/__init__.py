"""Sampling: the rejection sampler (torch reference and Triton kernels), random draws, processors."""
