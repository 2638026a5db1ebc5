"""The state every search stage works on (:class:`.base.SearchState` is its interface): the tables placed so far,
their summed loads and memory, and its score.

The state is the cost model's load and memory vectors summed over the placed tables' choices; a choice is added
and removed as vectors, so a move costs one scoring, not a re-evaluation of the plan. What is derived from the sums
(step time per GPU, free memory, the candidate GPUs) is cached until the next change. The state asks its
:class:`.base.OptionSource` for a table's options and :class:`persia_planner.search.device_choice.DeviceChoice` for
their best devices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from persia_planner.bound import TierChoice
from persia_planner.cost.analytic import CostModel
from persia_planner.model.specs import TableSpec
from persia_planner.placement.memory import ps_holds
from persia_planner.placement.shards import TablePlacement, even_split, server_bytes
from persia_planner.search.base import Choice, FreeRoom, Option, OptionSource, SearchConfig
from persia_planner.search.device_choice import DeviceChoice
from persia_planner.search.result import build_placement
from persia_planner.search.shards import ShardTerms
from persia_planner.search.steps import Tie
from persia_planner.tiers import Memory, Tier

__all__ = ["State"]

# Weight of the balance term in the search's score (the step time has weight 1).
_BALANCE_WEIGHT = 0.05
# Devices scored per shard placement beyond the least-loaded GPU of each candidate host.
_CANDIDATES = 8
# Hosts a decision considers (the least loaded): every host on clusters up to this size; beyond, scoring every host
# would make each decision, and so each table, cost hosts x GPUs (docs/decisions/0018-bounded-candidates.md).
CANDIDATE_HOSTS = 16
# Load-vector entries scored at once (rows x resources): bounds the scoring's temporaries on large clusters.
_SCORE_CHUNK = 1 << 22


class State:
    """Mutable state of one search (the result is frozen).

    Args:
        cost: The cost model every vector and score comes from.
        config: The search's knobs (its seed drives every tie-break).
        options: Enumeration: the options of a table worth scoring.
        prices: Memory prices (HBM, trainer DDR, PS DDR per byte) charged while constructing, if any.
        shards: The per-search cache of the tables' state-independent vectors (shared by constructions).
    """

    def __init__(
        self,
        cost: CostModel,
        config: SearchConfig,
        options: OptionSource,
        prices: Sequence[float] | None = None,
        shards: ShardTerms | None = None,
    ):
        self.cost = cost
        self.config = config
        self.option_source = options
        self.shards = shards or ShardTerms(cost)
        self.rng = np.random.default_rng(config.seed)
        self.loads = cost.fixed_loads()
        self.mem = cost.memory_vector()
        self.cap = cost.capacities()
        self._room = self.cap + 0.5  # validate() allows half a byte over
        self._servers_hold: dict[Memory, bool] = {}  # the capacities never change: asked once per memory
        self.choices: dict[str, Choice] = {}
        self.specs = {t.name: t for t in cost.model.tables}
        lay = cost.layout
        self.n_gpus, self.n_hosts, self.n_servers = lay.n_gpus, lay.n_hosts, lay.n_servers
        self.dtype_of = cost.dtype_of
        self.host_gpus = cost.host_gpus()  # not a pass over the GPUs per host: hosts x GPUs
        self.min_hbm = min(cost.topology.hbm_capacity(g) for g in cost.topology.gpus)
        # Table-row-wise needs the same GPU count on every host (TorchRec's layout); so do we.
        self.uniform_hosts = len({len(g) for g in self.host_gpus}) == 1
        # Hosts x their GPUs, where every host has as many: the least-loaded GPU per host is then one argmin.
        self.host_grid = np.array(self.host_gpus) if self.uniform_hosts and len(self.host_gpus[0]) else None
        self.host_devices = [tuple(int(g) for g in gpus) for gpus in self.host_gpus]
        self._gpu_hosts = cost.gpu_host.tolist()
        self._gpu_step: np.ndarray | None = None
        self._candidates: np.ndarray | None = None
        self._candidate_hosts: list[int] | None = None
        self._free: np.ndarray | None = None
        self._room_stats: FreeRoom | None = None
        self._mean_step: float | None = None
        # Construction charges memory at the relaxation's prices, so a choice that saves a little time but eats
        # scarce memory (a replica on every GPU, HBM for a cold table) pays for the room it takes from others.
        self.pricing = prices is not None
        priced = (
            dict(zip((Memory.DEVICE, Memory.HOST, Memory.SERVER), prices, strict=True)) if prices is not None else None
        )
        self.mem_price = cost.memory_vector(priced)
        self.devices = DeviceChoice(self)

    # ---- derived from the sums (cached until the state changes) ---------------------------------------------
    @property
    def gpu_step(self) -> np.ndarray:
        """Current step time per GPU."""
        if self._gpu_step is None:
            self._gpu_step = self.cost.gpu_step_ms(self.loads[None, :])[0]
        return self._gpu_step

    @property
    def mean_step(self) -> float:
        """The mean GPU step time."""
        if self._mean_step is None:
            step = self.gpu_step
            self._mean_step = float(step.sum() / len(step))  # np.mean's arithmetic, without its overhead
        return self._mean_step

    @property
    def free(self) -> np.ndarray:
        """Room left per memory slot. Bytes are whole numbers, so ``m <= free`` is exactly ``mem + m <= room``."""
        if self._free is None:
            self._free = self._room - self.mem
        return self._free

    def free_room(self, gpus: np.ndarray | None = None) -> FreeRoom:
        """Free HBM per GPU and free trainer DDR, as enumeration asks for them: of every GPU and host, or of the GPUs
        in the mask ``gpus`` and their hosts (a table's constraints)."""
        if gpus is not None:
            free_hbm = (self.cost.hbm_of(self.cap) - self.cost.hbm_of(self.mem))[gpus]
            hosts = np.unique(self.cost.gpu_host[gpus])
            free_ddr = (self.cost.ddr_of(self.cap) - self.cost.ddr_of(self.mem))[hosts]
            return FreeRoom(np.sort(free_hbm)[::-1].tolist(), float(free_ddr.sum()), float(free_ddr.max(initial=0.0)))
        if self._room_stats is None:
            free_hbm = self.cost.hbm_of(self.cap) - self.cost.hbm_of(self.mem)
            free_ddr = self.cost.ddr_of(self.cap) - self.cost.ddr_of(self.mem)
            self._room_stats = FreeRoom(np.sort(free_hbm)[::-1].tolist(), float(free_ddr.sum()), float(free_ddr.max()))
        return self._room_stats

    def candidates(self, exclude: Sequence[int] = ()) -> np.ndarray:
        """GPUs worth scoring for one more shard: the least-loaded GPU of each of the :data:`CANDIDATE_HOSTS`
        least-loaded hosts (every host on smaller clusters) plus the least-loaded GPUs overall.

        Scoring all GPUs gives the same choice almost always (a shard's own work goes to its GPU, its all-to-all
        pattern depends only on its host), at a fraction of the cost on large clusters. A host is ranked by its
        least-loaded GPU's step, which includes the host's NIC time: what one more shard there would wait on.
        """
        if not exclude and self._candidates is not None:
            return self._candidates
        step = self.gpu_step
        if exclude:
            step = step.copy()
            step[list(exclude)] = np.inf
        # By load (ties: the lower index), the first GPU of each host is its least-loaded one (np.argmin per host
        # gives the same); a few dozen GPUs in Python cost less than the numpy calls that would do it.
        order = np.argsort(step, kind="stable").tolist()
        picked = set(order[:_CANDIDATES])
        hosts, seen = self._gpu_hosts, set()
        wanted = min(self.n_hosts, CANDIDATE_HOSTS)
        for g in order:
            if hosts[g] not in seen:
                seen.add(hosts[g])
                picked.add(g)
                if len(seen) == wanted:
                    break
        picked.difference_update(exclude)  # those with an infinite step
        result = np.array(sorted(picked), dtype=np.intp)
        if not exclude:
            self._candidates = result
        return result

    def candidate_hosts(self) -> list[int]:
        """Hosts worth scoring for a whole-host placement (in index order): every host up to
        :data:`CANDIDATE_HOSTS`, else that many whose least-loaded GPU is least loaded (ties: the lower index)."""
        if self.n_hosts <= CANDIDATE_HOSTS:
            return list(range(self.n_hosts))
        if self._candidate_hosts is None:
            least = np.full(self.n_hosts, np.inf)
            np.minimum.at(least, self.cost.gpu_host, self.gpu_step)
            self._candidate_hosts = sorted(np.argsort(least, kind="stable")[:CANDIDATE_HOSTS].tolist())
        return self._candidate_hosts

    # ---- scoring --------------------------------------------------------------------------------------------
    def score(self, loads: np.ndarray) -> np.ndarray:
        """Step time plus a balance term: an 8-norm over the GPUs' step times and the hosts' NIC times.

        The max alone is flat wherever two resources tie; the norm still rewards relieving either of them, and
        breaks ties between devices towards the less loaded one.
        """
        return self.scores(loads)[0]

    def scores(self, loads: np.ndarray, added: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`score` of each row of ``loads`` (with the state's loads ``added`` to each), and its step time per
        GPU. Rows are scored a few at a time on large clusters: every row's scoring makes rows as long as the load
        vector, and hundreds of them at once would be most of the search's memory (each row's figures are the
        same bits however many are scored together)."""
        if loads.ndim == 1:
            loads = loads[None, :]
        at_once = max(1, _SCORE_CHUNK // loads.shape[1])
        if len(loads) > at_once:
            parts = [self.scores(loads[i : i + at_once], added) for i in range(0, len(loads), at_once)]
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        if added:
            loads = self.loads + loads
        every = self.cost.resource_ms(loads)
        step = every.max(axis=1)  # the step time: the slowest GPU or NIC
        scale = np.maximum(step, 1e-12)
        # The 8th power by squaring thrice (numpy's ** 8 calls pow() per element, 10x slower); np.mean's own
        # arithmetic (a sum, then a division by the count) without its per-call overhead.
        power = every / scale[:, None]
        power *= power
        power *= power
        power *= power
        balance = scale * (np.add.reduce(power, axis=1) / every.shape[1]) ** (1 / 8)
        return step + _BALANCE_WEIGHT * balance, every[:, : self.n_gpus]

    def scores_added(self, loads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`scores` of the state with each row of ``loads`` added."""
        return self.scores(loads, added=True)

    def scores_added_each(self, matrices: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`scores_added` of the matrices' rows, stacked (on large clusters, scored one matrix at a time
        rather than stacked: a copy of every candidate's row is as much memory again)."""
        if len(matrices) == 1:
            return self.scores_added(matrices[0])
        if sum(m.size for m in matrices) <= _SCORE_CHUNK:
            return self.scores_added(np.concatenate(matrices))
        parts = [self.scores_added(m) for m in matrices]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def score_of(self, choice: Choice) -> float:
        """The score of the state with ``choice`` added (as the device choice scored it; computed here if not)."""
        if choice.score is None:
            choice.score = float(self.score(self.loads + choice.loads)[0])
        return choice.score

    def current_score(self) -> float:
        return float(self.score(self.loads)[0])

    def stamp(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What a choice remembers of its scoring: the state's loads it was added to and the resulting GPU steps
        (a copy: a row of the scoring's matrix would keep every candidate's row alive with the choice)."""
        return self.loads, steps.copy()

    def fits(self, mem: np.ndarray) -> np.ndarray:
        """Whether each row of ``mem`` fits in the room left."""
        if mem.ndim == 1:
            mem = mem[None, :]
        return (mem <= self.free).all(axis=1)

    def pick(self, scores: np.ndarray, ok: np.ndarray, draw: bool = True) -> int:
        """The best-scored candidate that fits; ties (within 1e-12) broken by the seeded RNG, or :class:`.steps.Tie`
        raised where ``draw`` is false. In Python: a few dozen candidates cost less than the numpy calls."""
        values = [score if fits else math.inf for score, fits in zip(scores.tolist(), ok.tolist(), strict=True)]
        limit = min(values) * (1 + 1e-12)
        ties = [i for i, value in enumerate(values) if value <= limit]
        if len(ties) == 1:
            return ties[0]
        if not draw:
            raise Tie
        return int(self.rng.choice(np.array(ties)))

    def pick_untied(self, scores: np.ndarray, ok: np.ndarray) -> int:
        """:meth:`pick` where there is no tie; :class:`.steps.Tie` where it would draw."""
        return self.pick(scores, ok, draw=False)

    # ---- tables in and out ----------------------------------------------------------------------------------
    def changed(self) -> None:
        """Forget what was derived from the sums (after they were set directly)."""
        self._gpu_step = self._candidates = self._free = self._room_stats = self._mean_step = None
        self._candidate_hosts = None

    def add(self, name: str, choice: Choice) -> None:
        self.changed()
        stamp = choice.stamp
        if stamp is not None and stamp[0] is self.loads:
            self._gpu_step = stamp[1]  # this very sum was scored: the same bits
        choice.stamp = None  # of no use once added, and it holds a load vector of the state before
        self.choices[name] = choice
        self.loads = self.loads + choice.loads
        self.mem = self.mem + choice.mem

    def remove(self, name: str) -> Choice:
        choice = self.choices.pop(name)
        self.changed()
        self.loads = self.loads - choice.loads
        self.mem = self.mem - choice.mem
        return choice

    # ---- a table's options and their best devices -----------------------------------------------------------
    def options(self, table: TableSpec, explore: bool = False, hint: TierChoice | None = None) -> list[Option]:
        """The option source's options of ``table`` in this state."""
        return self.option_source.options(self, table, explore, hint)

    def best_choice(
        self, table: TableSpec, hint: TierChoice | None = None, explore: bool = False
    ) -> tuple[Choice | None, list[tuple[Choice, float]]]:
        """The best option for ``table`` now (only the hinted tier's options while one of them fits), and every
        option's best choice with its value (score plus memory at the construction's prices), best first."""
        if hint is not None:
            hinted = self.options(table, explore, hint)
            if hinted:
                choice, scored = self.devices.best_choice_of(table, hinted)
                if choice is not None:
                    return choice, scored
        return self.devices.best_choice_of(table, self.options(table, explore))

    def best_choice_of(
        self, table: TableSpec, options: list[Option]
    ) -> tuple[Choice | None, list[tuple[Choice, float]]]:
        """:meth:`best_choice` among ``options``."""
        return self.devices.best_choice_of(table, options)

    # ---- a table's constraints ------------------------------------------------------------------------------------
    def allowed_gpus(self, table: TableSpec) -> np.ndarray | None:
        """The GPUs ``table``'s constraints let its shards go to, as a mask over the GPUs; None where every one."""
        devices = table.constraints.devices
        if devices is None:
            return None

        def mask() -> np.ndarray | None:
            allowed = np.array([g.name in devices for g in self.cost.topology.gpus], dtype=bool)
            return None if allowed.all() else allowed

        return self.shards.whole(("allowed", table.name), mask)  # type: ignore[return-value]

    def every_server(self, table: TableSpec) -> bool:
        """Whether ``table``'s constraints let it go to every parameter server (``ps_hash`` hashes over all)."""
        devices = table.constraints.devices
        return devices is None or all(s.name in devices for s in self.cost.topology.servers)

    # ---- the parameter servers' share of a table ------------------------------------------------------------
    def ps_rows(self, table: TableSpec) -> np.ndarray:
        """Rows each server holds (one hash bucket each)."""
        return np.array(even_split(table.rows, self.n_servers), dtype=float)

    def server_bytes(self, table: TableSpec, tier: Tier, cache_fraction: float = 0.0) -> dict[Memory, np.ndarray]:
        """Bytes each server takes for the table on ``tier`` (a server tier), per server memory."""
        rows, dtype = self.ps_rows(table), self.cost.dtype_of(table)
        return server_bytes(table, tier, rows, table.dim, dtype, cache_fraction)

    def servers_hold(self, memory: Memory) -> bool:
        """Whether every parameter server has some of ``memory`` (a table hashes over all of them)."""
        held = self._servers_hold.get(memory)
        if held is None:
            held = self._servers_hold[memory] = bool(self.n_servers) and not self.cost.topology.without(memory)
        return held

    def ps_holds(self, table: TableSpec) -> bool:
        """Whether no server would hold more of the table's rows than its store can (see memory.PS_MAX_ROWS)."""
        return bool(ps_holds(table.rows, self.n_servers))

    def placement(self, name: str) -> TablePlacement:
        """The placed table's shards."""
        choice = self.choices[name]
        if choice.placement is not None:
            return choice.placement
        return build_placement(self.cost, self.specs[name], choice.option, choice.gpus)
