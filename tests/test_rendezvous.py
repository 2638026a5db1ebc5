"""modules/train/rendezvous.py: torchrun's ``persia`` rendezvous backend, its stores bound to the head's address."""

from __future__ import annotations

import shutil
import subprocess
from importlib.metadata import entry_points

import pytest

from persia_planner.modules.train import rendezvous


def _listening(port: int) -> list[str]:
    """The local addresses of the sockets listening on ``port`` (``ss``), e.g. ``127.0.0.1:1234`` or ``*:1234``."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, timeout=10).stdout
    return [line.split()[3] for line in out.splitlines()]


def _params(endpoint: str, **conf: str):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters("persia", endpoint, "run-1", 1, 1, **conf)


def test_torchrun_finds_the_backend_through_the_entry_point():
    (found,) = [e for e in entry_points(group="torchrun.handlers") if e.name == rendezvous.BACKEND]
    assert found.load()() is rendezvous.create_handler


@pytest.mark.processes  # ss
@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_both_stores_listen_on_the_given_address_only():
    handler = rendezvous.create_handler(_params("127.0.0.1:0", is_host="true"))
    assert handler.get_backend() == "persia"
    store = handler._state_holder._backend._store  # the rendezvous store the backend keeps its state in
    assert _listening(store.port) == [f"127.0.0.1:{store.port}"]
    # What rank 0's agent serves its workers (torch's DynamicRendezvousHandler asks for it by this name).
    workers = handler._create_tcp_store_server("127.0.0.1", 0)
    assert _listening(workers.port) == [f"127.0.0.1:{workers.port}"]
    workers.set("k", "v")
    assert workers.get("k") == b"v"


def test_the_head_must_be_named():
    with pytest.raises(ValueError, match=r"needs --rdzv-conf is_host=true on the head node, false elsewhere"):
        rendezvous.create_handler(_params("127.0.0.1:29400"))
