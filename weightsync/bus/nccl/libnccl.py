"""A minimal ctypes binding to libnccl, so services share an NCCL communicator without sharing
any torch.distributed state: the trainer makes an ncclUniqueId, sends its 128 bytes over gRPC,
and every rollout rank joins with it.

The library is found, in order, at the config's `debug.nccl_library`, in the `nvidia.nccl` wheel that CUDA builds
of torch depend on, or by the system loader. Loaded lazily: importing this module needs no GPU.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading

from weightsync.debug import switches

NCCL_UINT8 = 1
UNIQUE_ID_BYTES = 128


class NcclError(RuntimeError):
    pass


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]

    def to_bytes(self) -> bytes:
        return bytes(ctypes.string_at(ctypes.addressof(self), UNIQUE_ID_BYTES))

    @classmethod
    def from_bytes(cls, data: bytes) -> "UniqueId":
        if len(data) != UNIQUE_ID_BYTES:
            raise ValueError(f"nccl unique_id must be {UNIQUE_ID_BYTES} bytes, got {len(data)}")
        uid = cls()
        ctypes.memmove(ctypes.addressof(uid), data, UNIQUE_ID_BYTES)
        return uid


_lib = None
_lib_lock = threading.Lock()


def _candidates() -> list[str]:
    out = []
    if switches().nccl_library:  # the config's debug.nccl_library
        out.append(switches().nccl_library)
    try:
        import nvidia.nccl  # the wheel torch's CUDA builds depend on

        for root in list(getattr(nvidia.nccl, "__path__", [])):
            out += sorted(glob.glob(os.path.join(root, "lib", "libnccl.so*")))
    except ImportError:
        pass
    out += ["libnccl.so.2", "libnccl.so"]
    return out


def lib() -> ctypes.CDLL:
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        errors = []
        for path in _candidates():
            try:
                handle = ctypes.CDLL(path)
                break
            except OSError as exc:
                errors.append(f"{path}: {exc}")
        else:
            raise NcclError(
                "libnccl not found (set the config's debug.nccl_library, e.g. env WS_TRAINER_NCCL_LIBRARY / "
                "WS_ROLLOUT_NCCL_LIBRARY): " + "; ".join(errors)
            )
        handle.ncclGetErrorString.restype = ctypes.c_char_p
        handle.ncclGetErrorString.argtypes = [ctypes.c_int]
        handle.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
        handle.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
        handle.ncclBroadcast.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        handle.ncclCommAbort.argtypes = [ctypes.c_void_p]
        handle.ncclCommDestroy.argtypes = [ctypes.c_void_p]
        handle.ncclCommGetAsyncError.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        handle.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        _lib = handle
        return _lib


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise NcclError(f"{what} failed: NCCL error {rc} ({lib().ncclGetErrorString(rc).decode()})")


def version() -> int:
    v = ctypes.c_int()
    check(lib().ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
    return v.value


def new_unique_id() -> bytes:
    uid = UniqueId()
    check(lib().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return uid.to_bytes()


def comm_init_rank(world_size: int, unique_id: bytes, rank: int) -> ctypes.c_void_p:
    """Blocks until all `world_size` ranks have joined (callers bound it with a thread + deadline)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    comm = ctypes.c_void_p()
    check(
        lib().ncclCommInitRank(ctypes.byref(comm), world_size, UniqueId.from_bytes(unique_id), rank),
        f"ncclCommInitRank(rank {rank} of {world_size})",
    )
    return comm


def broadcast(comm: ctypes.c_void_p, ptr: int, nbytes: int, root: int, stream: int) -> None:
    check(
        lib().ncclBroadcast(
            ctypes.c_void_p(ptr), ctypes.c_void_p(ptr), nbytes, NCCL_UINT8, root, comm, ctypes.c_void_p(stream)
        ),
        "ncclBroadcast",
    )


def async_error(comm: ctypes.c_void_p) -> int:
    err = ctypes.c_int()
    check(lib().ncclCommGetAsyncError(comm, ctypes.byref(err)), "ncclCommGetAsyncError")
    return err.value


def abort(comm: ctypes.c_void_p) -> None:
    lib().ncclCommAbort(comm)


def destroy(comm: ctypes.c_void_p) -> None:
    lib().ncclCommDestroy(comm)
