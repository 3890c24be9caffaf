"""The local cluster behind `pdserve up`: a registry, N prefill + M decode (or C colocated) node processes and a
router on one machine, started in order and stopped together.

    plan.py      what to start: ClusterPlan (counts, ports, threads per process)
    children.py  one child process: own process group, dies with the launcher, log file, stop
    registry.py  a private redis-server, when one is installed
    cluster.py   LocalCluster: start in order, wait on /health, watch, stop everything
    env_flags.py container entrypoint: PDSERVE_* environment variables -> a command's flags

Torch-free: the launcher only starts processes.
"""
