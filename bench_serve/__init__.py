"""`pdserve bench serve`: a load generator and meter for any OpenAI-compatible endpoint.

    workload.py / trace.py ─► WorkItems ─┐
    arrivals.py ─► send times ───────────┼─► runner.py ─► client.py (one streamed request) ─► RequestRecords
                                         │                                                      │
                                         └────────────── metrics.py (Summary) ◄─────────────────┘
                                                         report.py (JSON, table), plots.py (PNG)

Torch-free, so it runs from any venv against pdserve's router or vLLM's server alike.
"""
