"""Routing policies: pure decision logic shared by the router service and the simulator."""
