"""A table's store on the parameter servers is the one its tier names (``TierSpec.store``): the servers import that
factory, treat every store alike (:class:`TableStore`) and say which store ran each table; a tier of a test's own,
with a store of its own, runs without any code naming it."""

from __future__ import annotations

import pytest
import torch

from persia_planner.kinds import Sharding
from persia_planner.model.dense import ArchKind, DenseArch, DenseSpec
from persia_planner.model.specs import ModelSpec, TableSpec
from persia_planner.modules.ps import server as server_module
from persia_planner.modules.ps import server_state
from persia_planner.modules.ps.protocol import MEMORY_STORE, PsServerError, RemoteFailure, TableConfig
from persia_planner.modules.ps.ssd_store import SsdStore
from persia_planner.modules.ps.store import EmbeddingStore
from persia_planner.modules.ps.table_store import TableStore, memory_store
from persia_planner.modules.train.ps_usage import server_usage
from persia_planner.placement.memory import ps_server_capacity, ssd_server_cache_capacity
from persia_planner.placement.shards import Shard, TablePlacement
from persia_planner.tiers import Lookups, Memory, Runtime, Tier, TierSpec, registered, server_tiers

DIM = 8


class CountingStore(EmbeddingStore):
    """An in-memory store that counts its closes: a store of a test's own."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def counting_store(config: TableConfig, index: int) -> CountingStore:
    """A store factory as a tier names one: ``(TableConfig, server index) -> store``."""
    return CountingStore(config.dim, config.capacity, config.optimizer, seed=config.seed + index)


NOT_A_FACTORY = 42
COUNTING = f"{__name__}:counting_store"
COUNTING_CLASS = f"{__name__}:CountingStore"


@pytest.fixture
def servers():
    """A fresh server state in this process (the request handlers called directly), its stores closed after."""
    server_state.reset_state()
    yield server_state.state()
    server_state.close_stores()
    server_state.reset_state()


def test_every_server_tier_names_a_store_the_servers_import():
    assert TableConfig("t", DIM, 10).store == MEMORY_STORE == Tier.PS.spec.store  # the default is the ps tier's
    assert server_state.store_factory(Tier.PS.spec.store) is memory_store
    for tier in server_tiers():
        assert callable(server_state.store_factory(tier.spec.store)), tier


def test_both_built_in_stores_are_table_stores_and_the_memory_one_closes_as_a_no_op(tmp_path):
    memory = server_state.make_store(TableConfig("m", DIM, 10), 0)
    disk = server_state.make_store(
        TableConfig("d", DIM, 10, store=Tier.SSD.spec.store, backing_rows=40, store_dir=str(tmp_path)), 1
    )
    assert type(memory) is EmbeddingStore and type(disk) is SsdStore
    assert isinstance(memory, TableStore) and isinstance(disk, TableStore)
    assert (disk.capacity, disk.cache.capacity) == (40, 10)  # backing rows on disk, capacity rows cached
    assert len(list(tmp_path.iterdir())) == 1  # the disk store's file of rows
    memory.lookup(torch.arange(5))
    memory.close()
    assert len(memory) == 5  # nothing released: the rows are in memory
    disk.close()
    assert list(tmp_path.iterdir()) == []  # the disk store removed its file


def test_a_disk_store_without_backing_rows_keeps_a_disk_of_its_cache(tmp_path):
    disk = server_state.make_store(TableConfig("d", DIM, 30, store=Tier.SSD.spec.store, store_dir=str(tmp_path)), 0)
    assert disk.capacity == disk.cache.capacity == 30
    disk.close()


def test_make_store_builds_the_store_the_config_names():
    store = server_state.make_store(TableConfig("t", DIM, 50, seed=4, store=COUNTING), 2)
    assert type(store) is CountingStore and store.capacity == 50
    assert server_state.store_factory(COUNTING) is counting_store  # imported once per path


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("no_such_module_of_ours:factory", "ModuleNotFoundError: No module named 'no_such_module_of_ours'"),
        (f"{__name__}:no_such_factory", "AttributeError"),
        (f"{__name__}:NOT_A_FACTORY", "TypeError: NOT_A_FACTORY is not callable (an int)"),
    ],
)
def test_a_store_path_the_servers_cannot_load_is_refused_naming_the_table_and_the_path(servers, path, why):
    config = TableConfig("clicks", DIM, 10, store=path)
    with pytest.raises(PsServerError) as info:
        server_state.make_store(config, 1)
    message = str(info.value)
    assert message.startswith(f"parameter server ps1: table 'clicks': its store {path!r} cannot be loaded (")
    assert why in message and "\n" not in message and "TierSpec.store" in message
    refused = server_module.create(config)  # a client registering it gets the same line back
    assert isinstance(refused, RemoteFailure) and f"table 'clicks': its store {path!r}" in refused.message
    assert "clicks" not in servers.tables


def test_a_store_path_that_is_not_module_colon_name_is_refused_in_the_config():
    for path in ("persia_planner.modules.ps.server_state", ":memory_store", "module:"):
        with pytest.raises(ValueError, match=r"^TableConfig\.store must be 'module:name' \(a store factory\), got"):
            TableConfig("t", DIM, 10, store=path)
    with pytest.raises(ValueError, match=r"^TableConfig\.backing_rows \(5\) must hold the cache's 10 rows$"):
        TableConfig("t", DIM, 10, backing_rows=5)


def test_the_servers_metrics_name_each_tables_store_and_closing_goes_through_the_store(servers, tmp_path):
    server_module.create(TableConfig("mem", DIM, 20))
    server_module.create(TableConfig("own", DIM, 20, store=COUNTING))
    ssd = TableConfig("disk", DIM, 20, store=Tier.SSD.spec.store, backing_rows=60, store_dir=str(tmp_path))
    server_module.create(ssd)
    for table in ("mem", "own", "disk"):
        for first in (0, 15):  # the second batch evicts from a full cache: to the disk, on the ssd tier
            server_module.lookup(table, torch.arange(first, first + 15), True, False)
    metrics = server_module.server_metrics()
    assert metrics["stores"] == {
        "mem": "persia_planner.modules.ps.store:EmbeddingStore",
        "own": COUNTING_CLASS,
        "disk": "persia_planner.modules.ps.ssd_store:SsdStore",
    }
    assert metrics["tables"]["disk"]["disk_writes"] > 0  # the ssd store's own counters still reach the metrics
    own = servers.tables["own"].store
    assert server_module.drop("own") is True and own.closed == 1  # a dropped table's store is closed
    assert len(list(tmp_path.iterdir())) == 1
    server_state.close_stores()  # at shutdown: every store, the disk one's file removed
    assert list(tmp_path.iterdir()) == []
    memory = {"store_bytes": 0, "resident_bytes": 0}
    (usage,) = server_usage([metrics], [memory], [memory], {})
    assert usage.stores == metrics["stores"] and usage.to_dict()["stores"]["own"] == COUNTING_CLASS


# ---- the trainers build each table's config from its tier's descriptor -----------------------------------------------
class ServersInProcess:
    """A ``PsClient``'s registration, answered by this process's server handlers (what building a model asks of
    the servers: each PS table registered)."""

    def register(self, config: TableConfig) -> None:
        answer = server_module.create(config)
        assert not isinstance(answer, RemoteFailure), answer

    def registered(self, table: str) -> bool:
        return table in server_state.state().tables


def _on(tier: Tier, servers: int, cache_fraction: float | None = None) -> TablePlacement:
    return TablePlacement(
        Sharding.PS_HASH,
        tuple(
            Shard(f"ps{i}", tier, (0, DIM), 0, hash=(i, servers), cache_fraction=cache_fraction) for i in range(servers)
        ),
    )


SPEC = ModelSpec(
    "stores",
    32,
    (TableSpec("mem", 5_000, DIM), TableSpec("disk", 20_000, DIM), TableSpec("own", 3_000, DIM)),
    dense=DenseSpec(arch=DenseArch(ArchKind.DLRM, num_dense=4, bottom=(DIM,), over=(4, 1))),
)


def test_build_model_gives_each_table_its_tiers_store_and_the_cache_and_backing_its_descriptor_says(servers, tmp_path):
    from persia_planner.modules.train.loop import build_model

    own_tier = TierSpec(
        name="counted",
        summary="a parameter server's DDR, its closes counted (a test's tier)",
        rows_in=Memory.SERVER,
        lookups=Lookups.SERVER,
        shardings=frozenset({Sharding.PS_HASH}),
        speed_rank=90,
        runtime=Runtime.PARAMETER_SERVER,
        store=COUNTING,
    )
    with registered(own_tier) as counted:
        plan = {"mem": _on(Tier.PS, 2), "disk": _on(Tier.SSD, 2, 0.1), "own": _on(counted, 2)}
        build_model(
            SPEC, plan, ps=ServersInProcess(), ps_servers=2, local_device=torch.device("meta"), ssd_dir=str(tmp_path)
        )
    configs = {name: t.config for name, t in servers.tables.items()}
    assert {name: c.store for name, c in configs.items()} == {
        "mem": MEMORY_STORE,
        "disk": Tier.SSD.spec.store,
        "own": COUNTING,
    }
    # the numbers of before: a cached tier's rows in its backing memory, its capacity the plan's cache
    assert (configs["mem"].capacity, configs["mem"].backing_rows) == (ps_server_capacity(5_000, 2), 0)
    assert (configs["disk"].capacity, configs["disk"].backing_rows) == (
        ssd_server_cache_capacity(20_000, 2, 0.1),
        ps_server_capacity(20_000, 2),
    )
    assert (configs["own"].capacity, configs["own"].backing_rows) == (ps_server_capacity(3_000, 2), 0)
    assert configs["disk"].store_dir == str(tmp_path)
    stores = server_module.server_metrics()["stores"]
    assert stores["own"] == COUNTING_CLASS and stores["disk"] == "persia_planner.modules.ps.ssd_store:SsdStore"


def test_build_model_sizes_each_store_as_plan_json_records_it(servers, tmp_path):
    """The runtime reads the stores' rows from the plan (store_rows, backing_rows), not from the planner's formulas."""
    import dataclasses

    from persia_planner.modules.train.loop import build_model

    def recorded(placement: TablePlacement, rows: int, backing: int = 0) -> TablePlacement:
        shards = tuple(dataclasses.replace(s, store_rows=rows, backing_rows=backing) for s in placement.shards)
        return dataclasses.replace(placement, shards=shards)

    plan = {
        "mem": recorded(_on(Tier.PS, 2), 4_321),
        "disk": recorded(_on(Tier.SSD, 2, 0.1), 333, 12_345),
        "own": _on(Tier.PS, 2),
    }
    build_model(
        SPEC, plan, ps=ServersInProcess(), ps_servers=2, local_device=torch.device("meta"), ssd_dir=str(tmp_path)
    )
    configs = {name: t.config for name, t in servers.tables.items()}
    assert (configs["mem"].capacity, configs["mem"].backing_rows) == (4_321, 0)
    assert (configs["disk"].capacity, configs["disk"].backing_rows) == (333, 12_345)
    assert configs["own"].capacity == ps_server_capacity(3_000, 2)  # none recorded: what the plan charged
