"""chunkserve.router"""
