"""Torch-free messages and registry records shared by the router and the nodes."""
