"""The prefix index: chained block keys and the Merkle map of which replica holds which block in which tier."""
