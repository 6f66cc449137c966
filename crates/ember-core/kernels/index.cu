// ember index kernels: written next.
