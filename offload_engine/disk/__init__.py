"""The disk tier: a keyed store of checksummed objects in local files, and its handlers."""
