"""Locust load tests (installed as ``chunkserve.loadtests`` so that ``chunkserve loadtest`` finds its locustfile)."""
