"""The remote tier: keyed objects in a store several instances share (Redis, Mooncake)."""
