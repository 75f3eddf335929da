"""Transfer handlers: one per (source, destination) medium pair."""
