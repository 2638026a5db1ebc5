import pytest
import torch

from persia_planner.modules.ps.sharding import server_of, table_salt
from persia_planner.placement.memory import ps_server_capacity


def test_stable_balanced_and_salted_by_table():
    ids = torch.randint(-(2**63), 2**63 - 1, (60_000,), generator=torch.Generator().manual_seed(0))
    servers = server_of("user", ids, 3)
    assert servers.min() >= 0 and servers.max() <= 2
    counts = torch.bincount(servers, minlength=3)
    assert (counts - 20_000).abs().max() < 600  # ~4 sigma of a fair split
    assert torch.equal(servers, server_of("user", ids.clone(), 3))  # a pure function of (table, id)
    small = torch.arange(1000)
    assert not torch.equal(server_of("user", small, 4), server_of("item", small, 4))  # tables spread differently
    assert table_salt("user") == table_salt("user") != table_salt("item")


def test_bad_server_count():
    with pytest.raises(ValueError, match="n_servers must be positive"):
        server_of("t", torch.tensor([1]), 0)


@pytest.mark.parametrize("rows", [10, 1_000, 100_000, 1_000_000])
@pytest.mark.parametrize("n_servers", [2, 3, 16])
def test_every_server_holds_its_share_of_a_tables_ids_within_the_planned_capacity(rows, n_servers):
    """persia train sizes each store for the plan's rows plus 4 standard deviations of the hash's imbalance
    (memory.ps_capacity): a table's ids, small integers or 64-bit hashes, never overflow it."""
    for table, ids in [("ids", torch.arange(rows)), ("hashed", torch.arange(rows) * 0x5E3779B97F4A7C15)]:
        counts = torch.bincount(server_of(table, ids, n_servers), minlength=n_servers)
        assert counts.max() <= ps_server_capacity(rows, n_servers), (table, counts.tolist())
