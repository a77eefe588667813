"""The stand-in engines (``kvroute fake-engine``): vLLM / SGLang HTTP APIs, metrics and KV events over the engine
model, prefill/decode legs, and the fleet launcher the demo and the benchmarks share. Packaged with kvroute."""
