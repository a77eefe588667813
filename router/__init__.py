"""The kvroute service: configuration, HTTP app, proxy, tokenizer, telemetry and CLI."""
