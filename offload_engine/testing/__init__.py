"""The testing kit: fakes and helpers for driving an engine deterministically.

Part of the public API, for this project's tests and for anyone testing code
built on the engine. It imports no benchmark (``bench``) and no command
(``cli``): the benchmarks use its caches and servers, never the other way round.

Handlers
    :class:`FakeHandler` (scriptable latency, manual completion, failures),
    :class:`FaultyHandler` with :class:`FaultPlan` and :class:`Fault`
    (faults injected on worker threads), :class:`Ledger` (checks that each
    job got exactly one result its fault allows), :func:`assert_exactly_once`,
    :func:`engine_threads`, :func:`call_in_thread` (a call that fails instead of hanging).
Device runtimes
    :class:`FakeRuntime` (a CUDA-like runtime backed by host memory, with a
    worker thread per stream, several devices if asked, and its calls recorded
    as :class:`BatchCall` and :class:`KernelCall`) and :class:`FakeNpuRuntime` over
    :class:`FakeAscend` (a fake ``torch_npu`` and ``libascendcl``).
KV caches
    :func:`build_layout` (every layout in :data:`LAYOUT_KINDS`),
    :func:`random_host_cache`, :func:`poisoned_tier`, :func:`cache_block_bytes`.
Servers
    :class:`RedisServer`, :class:`RedisClusterServers` (with :class:`TlsFiles`) and
    :class:`MooncakeMaster`: real servers on 127.0.0.1, started and stopped by the
    caller; :func:`free_port`.
"""

from offload_engine.testing._fake_acl import (
    ACL_ERROR_INVALID_PARAM,
    ACL_ERROR_RT_CONTEXT_NULL,
    ACL_ERROR_RT_PARAM_INVALID,
    ACL_SUCCESS,
    AclBatchCall,
    AclCopyCall,
    FakeAscendCL,
    FakeNpuError,
    FakeNpuEvent,
    FakeNpuStream,
)
from offload_engine.testing._fake_handler import (
    FakeHandler,
    FakeTransferFailure,
    JobPredicate,
    assert_exactly_once,
    call_in_thread,
    engine_threads,
)
from offload_engine.testing._fake_npu import (
    FakeAscend,
    FakeNpuRuntime,
    FakeTorchNpu,
    fake_torch_npu_module,
)
from offload_engine.testing._fake_runtime import (
    BatchCall,
    FakeDeviceError,
    FakeDeviceMemory,
    FakeEvent,
    FakeRuntime,
    FakeStream,
    KernelCall,
    SerialStream,
)
from offload_engine.testing._faults import (
    Fault,
    FaultPlan,
    FaultyHandler,
    InjectedFault,
    Ledger,
    LedgerReport,
    check_outcome,
    outcome_name,
)
from offload_engine.testing._layouts import (
    LAYOUT_KINDS,
    Allocator,
    build_layout,
    cache_block_bytes,
    group_of,
    random_ids,
)
from offload_engine.testing.caches import poisoned_tier, random_host_cache
from offload_engine.testing.servers import (
    MooncakeMaster,
    RedisClusterServers,
    RedisServer,
    TlsFiles,
    free_port,
)

__all__ = [
    "ACL_ERROR_INVALID_PARAM",
    "ACL_ERROR_RT_CONTEXT_NULL",
    "ACL_ERROR_RT_PARAM_INVALID",
    "ACL_SUCCESS",
    "LAYOUT_KINDS",
    "AclBatchCall",
    "AclCopyCall",
    "Allocator",
    "BatchCall",
    "FakeAscend",
    "FakeAscendCL",
    "FakeDeviceError",
    "FakeDeviceMemory",
    "FakeEvent",
    "FakeHandler",
    "FakeNpuError",
    "FakeNpuEvent",
    "FakeNpuRuntime",
    "FakeNpuStream",
    "FakeRuntime",
    "FakeStream",
    "FakeTorchNpu",
    "FakeTransferFailure",
    "Fault",
    "FaultPlan",
    "FaultyHandler",
    "InjectedFault",
    "JobPredicate",
    "KernelCall",
    "Ledger",
    "LedgerReport",
    "MooncakeMaster",
    "RedisClusterServers",
    "RedisServer",
    "SerialStream",
    "TlsFiles",
    "assert_exactly_once",
    "build_layout",
    "cache_block_bytes",
    "call_in_thread",
    "check_outcome",
    "engine_threads",
    "fake_torch_npu_module",
    "free_port",
    "group_of",
    "outcome_name",
    "poisoned_tier",
    "random_host_cache",
    "random_ids",
]
