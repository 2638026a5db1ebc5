"""A client's gradient pushes: summed per id, narrowed for the wire, sent to the ids' servers, tracked until a flush.

A push de-duplicates its batch (:func:`.server_requests.distinct_ids`) and **sums the gradients of duplicate ids on the
client** (``index_add_``, in float32), so each server receives each id once (and is told so: it skips its own
de-duplication) and the wire carries ``distinct ids x dim`` values, not ``ids x dim``. With a narrower wire dtype the
float32 sum is rounded once; a finite sum that would overflow it is refused (:class:`~.protocol.WireOverflowError`),
never sent as ``inf``.

Pushes are fire-and-forget until :meth:`GradientPushes.flush`, which waits for every outstanding push and raises the
first error of the pushes since the previous flush (also of one that failed before it was called).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.futures import Future

from persia_planner.modules.ps import protocol
from persia_planner.modules.ps.protocol import WireOverflowError
from persia_planner.modules.ps.server_requests import ServerRequests, distinct_ids

__all__ = ["GradientPushes"]


class GradientPushes:
    """The gradient pushes of one client (:meth:`.client.PsClient.push_gradients_async` and ``flush``).

    Args:
        requests: The client's request channel.
        wire_dtype: The dtype the summed gradients travel in (checked by the client).
    """

    def __init__(self, requests: ServerRequests, wire_dtype: torch.dtype) -> None:
        self.requests = requests
        self.wire_dtype = wire_dtype
        self._pending: set[Future] = set()
        self._failed: BaseException | None = None  # the first push that failed since the last flush()
        self._pending_lock = threading.Lock()

    def send(
        self,
        table: str,
        dim: int,
        ids: torch.Tensor,
        grads: torch.Tensor,
        *,
        track: bool,
        optimizer: Any = None,
    ) -> Future:
        """Push ``grads`` ``[*ids.shape, dim]`` of ``ids`` to ``table`` (``optimizer``: this push's hyper-parameters,
        None: the table's own); the future holds the number of rows the servers updated. ``track=False`` leaves the
        push out of :meth:`flush` (its caller waits).

        Raises:
            ValueError: ``grads`` do not match ``ids`` x ``dim``.
            WireOverflowError: A finite summed gradient exceeds the range of :attr:`wire_dtype`; nothing is sent.
        """
        flat = ids.reshape(-1)
        if flat.dtype == torch.uint64:
            flat = flat.view(torch.int64)
        # The last axis must be dim too: a transposed [dim, n] tensor has the right numel but would be misassigned.
        if grads.numel() != flat.numel() * dim or grads.dim() == 0 or grads.shape[-1] != dim:
            raise ValueError(f"grads of shape {tuple(grads.shape)} do not match ids {tuple(ids.shape)} x dim {dim}")
        if flat.numel() == 0:
            done: Future = Future()
            done.set_result(0)
            return done
        uniq, inverse = distinct_ids(flat)
        order, pieces = self.requests.split(table, uniq)
        # Sum duplicates here: the servers get one gradient row per distinct id (less traffic, same result).
        summed = torch.zeros(uniq.numel(), dim).index_add_(0, inverse, grads.reshape(-1, dim).to(torch.float32))
        if self.wire_dtype != torch.float32:
            summed = self._to_wire(table, summed)  # rounded once, after the float32 sum
        # distinct=True: the ids are unique, so the server skips its own de-duplication and summation.
        hyper = () if optimizer is None else (optimizer,)
        if len(pieces) == 1:  # one owner: the whole (fresh) tensors travel, no reordering or copies
            ((i, _, _),) = pieces
            futs = [self.requests.call(i, protocol.update, (table, uniq, summed, True, *hyper), "push", table)]
        else:
            sorted_ids, sorted_grads = uniq[order], summed[order]
            futs = [
                self.requests.call(
                    i,
                    protocol.update,
                    (table, sorted_ids[a:b].clone(), sorted_grads[a:b].clone(), True, *hyper),
                    "push",
                    table,
                )
                for i, a, b in pieces
            ]
        out = self.requests.combined(futs, sum)
        if not track:
            return out
        with self._pending_lock:
            self._pending.add(out)

        def forget(f: Future) -> None:
            try:
                f.wait()  # done already: returns at once, or raises the push's error
                failed = None
            except Exception as err:
                failed = err
            with self._pending_lock:
                if f in self._pending:  # else a flush() claimed it and reports its error itself
                    self._pending.discard(f)
                    # A fire-and-forget push that fails before flush() is called must still be reported by it.
                    self._failed = self._failed or failed

        out.add_done_callback(forget)
        return out

    def _to_wire(self, table: str, summed: torch.Tensor) -> torch.Tensor:
        """``summed`` in :attr:`wire_dtype`; raises where a finite gradient would turn into ``inf``.

        An ``inf`` gradient would make the row's weights ``inf`` or ``nan`` on the server for good, so the push is
        refused instead. Gradients that already hold ``inf`` or ``nan`` pass as they would in float32.

        Raises:
            WireOverflowError: A finite summed gradient exceeds the largest value of :attr:`wire_dtype`.
        """
        # One reduction over the float32 sum: CPU float16 has no fast isinf to scan the narrowed copy with.
        peak = summed.abs().amax()
        if not torch.isfinite(peak):
            # A nan or inf elsewhere must not hide a finite value that overflows: look at the finite ones only.
            peak = torch.where(torch.isfinite(summed), summed.abs(), 0.0).amax()
        if torch.isinf(peak.to(self.wire_dtype)):
            fixes = ("scale the gradients down (lower the learning rate or the loss scale)",)
            if self.wire_dtype == torch.float16:
                fixes = ("send bfloat16 (wire_dtype=torch.bfloat16, --ps-wire bfloat16)", *fixes)
            raise WireOverflowError(
                f"gradients of table {table!r} overflow {self.wire_dtype} on the wire (wire_dtype / --ps-wire): "
                f"largest summed |gradient| {float(peak):.6g} > {torch.finfo(self.wire_dtype).max:.6g}",
                fixes=fixes,
            )
        return summed.to(self.wire_dtype)

    def flush(self) -> None:
        """Wait for every outstanding push; raises the first error of the pushes made since the previous flush
        (after all completed), also of those that failed before this call. The error is reported once."""
        with self._pending_lock:
            # Claim the outstanding pushes: their errors are reported by this call, not recorded by their callbacks
            # (a future's waiters may wake before its done-callback ran), so each error is reported exactly once.
            pending = list(self._pending)
            self._pending.clear()
        first: BaseException | None = None
        for f in pending:
            try:
                f.wait()
            except Exception as err:
                first = first or err
        with self._pending_lock:
            first, self._failed = self._failed or first, None  # one that failed before this call came first
        if first is not None:
            raise first
