"""Wire formats of exported tensors, shared by the trainer (encode) and the rollout (decode).

A format changes what a tensor looks like on the weight bus (its dtype, extra companion
tensors), never how buckets are planned, packed or moved: `weightsync.bus` carries its bytes
like any others, and the manifest says which format they are in.
"""
