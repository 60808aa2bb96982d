"""Helpers for tests and benchmarks (fixtures and pytest hooks stay in tests/conftest.py).

* data: where the real DVID files are (DVID_DATA, REAL_SHARD), skip or fail when absent.
* exports: synthetic exports written by the project's writer (Export, make_export), downsample_mode,
  load_shard, and what tests do to a copy of an export (copy_export, crop, ts_read, shard_records,
  consolidate, spec_file, THREE_SHARDS).
* blocks: DVID blocks built apart from the codec (build_block, random_block), TensorStore's
  compressed_segmentation encoding (ts_encode), the blocks an export holds (export_blocks).
* downsample: reference downsampling rules (a port of DVID's, by counts).
* sparsevol: reference sparsevol encoders and random body masks.
* mesh_volume: a small segmentation for the mesh tests and its per-chunk fragments.
* pcg: PCG edges/components decoded independently, brute-force edges.
* tables: Morton codes by brute force, an export's records, equality of two datasets.
* cli: the command line run in-process (run, one_line).
* fuzz, procedural, servers: the fuzz harness, the procedural mCNS export, loopback range/S3/GCS servers.
"""
