"""Device runtimes: the seam between the device handler and an accelerator (cuda, npu)."""
