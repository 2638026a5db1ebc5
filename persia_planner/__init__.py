"""persia-planner: place huge embedding tables on GPU HBM, host DDR and parameter servers.

The public API is small::

    from persia_planner import load_model, load_topology, plan
    p = plan(load_model("model.yaml"), load_topology("topology.yaml"))
    p.save("plan.json")

Nothing here imports torch; the TorchRec export and the training modules import it lazily.
"""

from persia_planner.cost.analytic import Cost, CostModel
from persia_planner.errors import CapacityError, ErrorKind, PlannerError, SpecError
from persia_planner.kinds import Mode, Sharding
from persia_planner.model.dense import ArchKind, DenseArch
from persia_planner.model.specs import DenseSpec, DType, ModelSpec, Optimizer, TableSpec, load_model
from persia_planner.placement.shards import Shard, Storage, TablePlacement
from persia_planner.plan.plan import Plan, load_plan
from persia_planner.plan.validation import validate
from persia_planner.planner import Planner, plan
from persia_planner.search import GreedyLocalSearch, SearchConfig
from persia_planner.tiers import Tier
from persia_planner.topology.cost_constants import CostConstants
from persia_planner.topology.graph import Topology, load_topology
from persia_planner.units import Quantity, parse

__all__ = [
    "ArchKind",
    "CapacityError",
    "Cost",
    "CostConstants",
    "CostModel",
    "DType",
    "DenseArch",
    "DenseSpec",
    "ErrorKind",
    "GreedyLocalSearch",
    "Mode",
    "ModelSpec",
    "Optimizer",
    "Plan",
    "Planner",
    "PlannerError",
    "Quantity",
    "SearchConfig",
    "Shard",
    "Sharding",
    "SpecError",
    "Storage",
    "TablePlacement",
    "TableSpec",
    "Tier",
    "Topology",
    "load_model",
    "load_plan",
    "load_topology",
    "parse",
    "plan",
    "validate",
]
__version__ = "0.1.0"
