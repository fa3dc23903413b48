"""FAKE cuda_ops that fails like the real one on a CPU-only host."""

raise ImportError("libc10_cuda.so: cannot open shared object file: No such file or directory")
