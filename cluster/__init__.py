"""chunkserve.cluster"""
