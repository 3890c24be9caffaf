"""What the machine gives the engine, and the choices that follow: CPUs and memory
(``resources``), the device's dtype and attention backend (``device``), the torch threads and the
KV pool's size (``sizing``), OpenMP's wait policy (``cpu_env``) and the thread count that gives
way to other processes' load (``cpu_share``). Chosen once at start-up, except the last.
"""
