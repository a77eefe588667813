"""What exercises the router without GPUs: traces, engine model, fake engine, simulator, benchmarks."""
