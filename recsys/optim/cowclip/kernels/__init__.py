"""The CowClip kernels, one per device: the C++ op on CPU (``cpp_op``: loads the op built at install
time, else builds it just in time), Triton on CUDA (``triton_update``, ``triton_catchup``).
``dispatch`` picks one by device and passes a table group's hyperparameters to it.

Submodules are imported by their full names; importing this package imports nothing else.
"""
