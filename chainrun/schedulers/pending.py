"""Pending reasons that will not clear by themselves, in the scheduler's own words.

A job the scheduler keeps pending for one of these waits for a change to its own request (or
to the cluster's limits), never for other jobs to end: ``status``, ``run``, the web page and
the webhook say so, with what to change. Only Slurm names such states in its listing; SGE's
is its error state, which ends the segment (``ListedJob.stuck``). A table and a look-up, so
that ``status`` can read it without loading a backend.
"""

from __future__ import annotations

# Slurm's reason -> what to change. ReqNodeNotAvail is not one: a node that does not exist
# is refused at submission (check asks first), and a node down or drained may come back.
NEVER_CLEARS: dict[str, str] = {
    "PartitionNodeLimit": "it asks for more nodes than its partition allows: change --nodes, or queue",
    "PartitionTimeLimit": "its walltime is over its partition's MaxTime: shorten walltime, or change queue",
    "PartitionConfig": "it asks for more than its partition has: change [scheduler] options, or queue",
    "QOSMaxWallDurationPerJobLimit": "its walltime is over its QOS limit: shorten walltime, or change --qos",
    "AssocMaxWallDurationPerJobLimit": "its walltime is over its account's limit: shorten walltime",
    "QOSMaxNodePerJobLimit": "it asks for more nodes than its QOS allows: change --nodes, or --qos",
    "AssocMaxNodesPerJobLimit": "it asks for more nodes than its account allows: change --nodes",
    "QOSMaxCpuPerJobLimit": "it asks for more CPUs than its QOS allows: change [scheduler] options, or --qos",
    "AssocMaxCpuPerJobLimit": "it asks for more CPUs than its account allows: change [scheduler] options",
    "QOSMaxGRESPerJob": "it asks for more GRES (GPUs) than its QOS allows: change options, or --qos",
    "QOSMaxMemoryPerJob": "it asks for more memory than its QOS allows: change --mem, or --qos",
    "InvalidQOS": "its QOS is not one this user may use: change --qos",
    "InvalidAccount": "its account is not one this user may use: change --account",
    "BadConstraints": "its constraints match no node: change --constraint",
}


def will_not_start(reason: str) -> str:
    """What to change for a job kept pending for ``reason`` when that reason will not clear
    by itself; "" for one that may (Priority, Resources, Dependency, ...)."""
    return NEVER_CLEARS.get(reason.split(",")[0].strip(), "")
