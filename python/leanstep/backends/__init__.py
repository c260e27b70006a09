"""Device backends: the same operations as the C++ kernels, for tensors on any
torch device: ``torch_*`` (torch ops) and ``triton_*`` (Triton kernels).

Which op each backend implements, and how, is in the op registry
(:mod:`leanstep._registry`); ``leanstep.paths()`` lists it beside the C++
registry's CPU implementations. Backends import nothing of the package API.
"""
