"""`pdserve plan`: measure the engine offline, then predict a cluster's latencies without running it.

    calibrate.py / transfer_probe.py ─► profile.py (Profile, JSON) ─► simulate.py (discrete-event model)
                                                                          │
                                                          recommend.py (search node counts) ◄─┘

Everything but the two measuring modules is torch-free: the simulator needs only a profile.
"""
