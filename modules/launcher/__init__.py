"""The job's processes: launching the trainers and the parameter servers, their rendezvous, their lifecycle.

:func:`~persia_planner.modules.launcher.launch.local_cluster` runs ``n`` servers and ``m`` trainers on this machine,
forked from a fork server (:mod:`.forkserver_hooks`), in a rendezvous store it hosts before any of them starts
(:func:`~persia_planner.modules.launcher.launch.hosted_store`; the trainers' own namespace in it, under torchrun too:
:func:`~persia_planner.modules.launcher.launch.trainers_store`); :mod:`.workers` holds the bodies of its processes,
:mod:`.local_job` awaits their reports, :mod:`.lifecycle` makes them die with their launcher and stops them on a
signal, and :mod:`.progress` names a trainer that hangs. The servers themselves (what they serve, the client and the
RPC group they join) are the parameter server's, :mod:`persia_planner.modules.ps`, which never imports this package.
"""

from __future__ import annotations

from persia_planner.modules.lazy_exports import lazy_exports

__all__ = [
    "ProgressWatch",
    "TrainerError",
    "barrier",
    "exit_now",
    "hosted_store",
    "local_cluster",
    "publish_progress",
    "reserved_port",
    "trainers_store",
    "use_hosted_store",
]

_HOMES = {
    "ProgressWatch": "persia_planner.modules.launcher.progress",
    "TrainerError": "persia_planner.modules.launcher.local_job",
    "barrier": "persia_planner.modules.launcher.workers",
    "exit_now": "persia_planner.modules.launcher.lifecycle",
    "hosted_store": "persia_planner.modules.launcher.launch",
    "local_cluster": "persia_planner.modules.launcher.launch",
    "publish_progress": "persia_planner.modules.launcher.progress",
    "reserved_port": "persia_planner.modules.launcher.launch",
    "trainers_store": "persia_planner.modules.launcher.launch",
    "use_hosted_store": "persia_planner.modules.launcher.workers",
}


__getattr__ = lazy_exports(__name__, _HOMES)
