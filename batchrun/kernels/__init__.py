"""Kernels: C for CPUs (cpu/), Triton for GPUs (triton/), over the data layouts both share (layouts/)."""
