"""Formats: pure functions and kernels over bytes and arrays, no I/O.

The DVID block codec, the Arrow IPC reader, record tables, chunk indexes, the neuroglancer
multiscale spec, sharding arithmetic and label sources.  Nothing here imports from the layers
above (stores, shard, read, dataset, jobs).
"""
