"""ctypes bindings of the C kernels in ``kvserve/csrc``, one module per library: each builds
its library on first use (``kvserve.cbuild``), declares the argument types once, and wraps
every entry point in a function taking tensors. Nothing else in kvserve loads a library."""
