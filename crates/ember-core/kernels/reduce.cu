// ember reduce kernels: written next.
