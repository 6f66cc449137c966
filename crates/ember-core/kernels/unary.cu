// ember unary kernels: written next.
