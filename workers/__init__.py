"""chunkserve.workers"""
