"""Host memory: the host tier (a pool of blocks), KV layouts, and the host copy handler."""
