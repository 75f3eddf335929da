"""The accelerator (GPU, NPU): the device copy handler and its runtimes."""
