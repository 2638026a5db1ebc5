"""glibc allocator tuning for the processes of a PS group, whose requests allocate and free MB-sized buffers.

Two halves, because glibc takes some settings only at process start: :func:`allocator_env` is the environment to start
a server or trainer with (:func:`.launcher.launch.local_cluster` does), :func:`tune_allocator` what a running process
can still change (``mallopt``; :func:`.server.serve` and :func:`persia_planner.modules.ps.connection.connect` call it).
``PS_TUNE_MALLOC=0`` turns both off. Nothing here depends on torch: other platforms simply skip it.
"""

from __future__ import annotations

import os

__all__ = ["allocator_env", "tune_allocator"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc mallopt parameters (malloc.h)
# glibc tunables for request buffers (see allocator_env), each applied unless the environment already names it.
_TUNABLES = {"glibc.malloc.tcache_count": "0", "glibc.malloc.hugetlb": "1"}
_tuned = False


def allocator_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables to start a server or trainer process with so that its request buffers stay warm.

    * ``glibc.malloc.tcache_count=0``: torch allocates tensors with ``posix_memalign(64)``; glibc puts the few bytes
      it trims off each aligned chunk into the thread's tcache, where they can never merge, so a freed MB-sized
      tensor cannot be reused for the next one of the same size and every request's tensors land on fresh pages
      (4,096 page faults for the 16 MB answer of a 64k-id lookup).
    * ``glibc.malloc.hugetlb=1`` (glibc >= 2.35; older ones ignore it): the heap is advised ``MADV_HUGEPAGE``, so
      the MB-sized buffers every request writes, sends and reads (ids, the answer's rows, the expanded batch) sit on
      transparent huge pages: fewer TLB misses in each copy, and TensorPipe's cross-process read (``cma``) pins 2 MiB
      pages instead of 4 KiB ones. The RPC of a lookup's answer and lookups in flight got faster with it; one
      blocking lookup not measurably. The heap then holds some 75 MB of huge pages in a client, 150 MB in a server.

    Both take effect only at process start, hence an environment (:func:`.launcher.launch.local_cluster` starts its
    processes with it). Returns ``{"GLIBC_TUNABLES": ...}``: ``environ``'s value with the tunables it does not
    already name appended (the user's own setting of one stands), or ``{}`` if it names both or
    ``PS_TUNE_MALLOC=0``.
    """
    environ = os.environ if environ is None else environ
    current = environ.get("GLIBC_TUNABLES", "")
    if environ.get("PS_TUNE_MALLOC", "1") == "0":
        return {}
    named = {item.split("=", 1)[0] for item in current.split(":") if item}
    missing = [f"{name}={value}" for name, value in _TUNABLES.items() if name not in named]
    if not missing:
        return {}
    return {"GLIBC_TUNABLES": ":".join([current, *missing] if current else missing)}


def tune_allocator() -> bool:
    """Keep freed request-sized buffers in the process instead of returning them to the OS (glibc only).

    Every request allocates a few MB-sized tensors (ids, rows, the gathered answer) and frees them once sent. With
    glibc's defaults most of them are fresh mappings: each first write page-faults (about 1,600 faults for the
    6.6 MB answer of a 64k-id batch), and the RPC agent's worker threads each warm their own arena. One
    arena, ``malloc`` up to 32 MiB from the heap and trimming only above 256 MiB of free heap make the buffers of
    the previous request serve the next one. Larger allocations (the stores' tables) are still mapped lazily.
    Call it before the process starts threads (``init_rpc``); :func:`.server.serve` and
    :func:`persia_planner.modules.ps.connection.connect` do. Returns whether it applied (False on a non-glibc platform
    or if ``PS_TUNE_MALLOC=0``).
    """
    global _tuned
    if _tuned:
        return True
    if os.environ.get("PS_TUNE_MALLOC", "1") == "0":
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        ok = all(
            libc.mallopt(param, value) == 1
            for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 256 << 20))
        )
    except (OSError, AttributeError):
        return False
    _tuned = ok
    return ok
