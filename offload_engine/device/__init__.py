"""The accelerator (GPU, NPU): the device copy handler, its configuration, the tier
factory, and the runtimes (``runtimes/``) it is written against."""

from offload_engine.device.config import CopyStrategy, DeviceHandlerConfig
from offload_engine.device.factory import make_device_handlers, pinned_host_tier
from offload_engine.device.handler import DeviceCopyHandler

__all__ = [
    "CopyStrategy",
    "DeviceCopyHandler",
    "DeviceHandlerConfig",
    "make_device_handlers",
    "pinned_host_tier",
]
