// ember random kernels: written next.
