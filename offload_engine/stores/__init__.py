"""What keyed tiers talk to: local files (:mod:`offload_engine.stores.disk`)."""
