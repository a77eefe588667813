"""Tooling, not product (never packaged, never in the image): benchmarks, end-to-end runs, soak and abuse tests,
the locust file, the real-engine harness and the test gateway client. Run from a checkout: ``python -m
loadtest.<module>``."""
