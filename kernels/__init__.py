"""chunkserve.kernels"""
