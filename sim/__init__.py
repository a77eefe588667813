"""The fleet simulator (``kvroute simulate``), traces and workloads, the HTTP replay and ``kvroute demo``.
Packaged with kvroute."""
