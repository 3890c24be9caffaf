"""`pdserve plan`: measure the engine offline, then predict a cluster's latencies without running it.

    calibrate.py / transfer_probe.py (/ contention.py) ─► profile.py (Profile, JSON) ─► simulate.py (the model)
                                                                          │
                                                          recommend.py (search node counts) ◄─┘

Everything but the measuring modules is torch-free: the simulator needs only a profile.
"""
