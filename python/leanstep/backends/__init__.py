"""Device backends: the same operations as the C++ kernels, for tensors on any torch device."""
