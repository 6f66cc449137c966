// ember softmax kernels: written next.
