"""Reading and moving a bucket's words: the `ws-sum64-v1` checksum and the copies that compute it as they go.

- `checksum`: the bucket checksum (same value on CPU and GPU), its batched and in-flight forms;
  `checksum_regions`: the sums of a buffer's words outside some byte ranges (the rest of a bucket
  whose other words a kernel summed as it wrote them);
- `verified_copy`: a received bucket copied out of the bus buffer and checksummed in the same pass;
  `scatter_rows`: that copy's work table (16-byte-aligned rows), built once per layout;
- `shard_copy`: a tensor-parallel rank's shards copied out of a bucket, with sums the ranks add up to the
  bucket's (SGLang's TP workers);
- `copy_runs`: many strided-view copies (a layout's converted tensors) planned once as contiguous runs.

Each has its Triton side in `<name>_triton` (`checksum_triton`, `scatter_triton`, `copy_runs_triton`),
used on a CUDA GPU where `weightsync.triton_support.available()`; torch does the same work elsewhere,
bit for bit.
"""
