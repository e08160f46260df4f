"""Device-generic instruments of the lab (bench and experiments): step timing, transient
memory, bytes written, contention.

Every function takes the device the work runs on and picks the instrument:

==================  =======================================  ==================================
figure              CPU                                      CUDA
==================  =======================================  ==================================
time of a step      ``time.perf_counter`` around the call    CUDA events around the call, then
                    (CPU ops are synchronous)                ``event.synchronize()``
transient memory    ``torch.profiler`` memory events         ``torch.cuda.memory_stats`` deltas
                    (``profile_memory=True``): every         (``allocated_bytes.all.allocated``
                    allocation/free with its size and op     / ``freed``) and
                                                             ``max_memory_allocated`` - before
bytes written       a ``TorchDispatchMode`` that adds up what every aten op writes (both devices)
op counts           a ``TorchDispatchMode`` that counts ops, host syncs (scalar reads, data-dependent
                    shapes, device-to-host copies) and fresh outputs (both devices); compiled
                    functions: what ``torch.compile`` captured (graphs, recompiles, graph ops)
==================  =======================================  ==================================

Timing interleaves the subjects (one step of each per round, the order rotating), so
that the noise of a shared machine (another process, a vCPU descheduled for a tick)
hits every subject alike; it reports the whole distribution, not just a median.
"""

from streamkv_lab.measure.counts import CompiledCounts, DispatchCounts, count_compiled, count_dispatch, is_sync_op
from streamkv_lab.measure.device import check_device, sync
from streamkv_lab.measure.load import ForeignLoad, spin_load
from streamkv_lab.measure.memory import TransientMemory, page_faults, probe_transient
from streamkv_lab.measure.timing import Stats, TimingRun, time_interleaved
from streamkv_lab.measure.written import WrittenBytes, count_written_bytes

__all__ = [
    "CompiledCounts",
    "DispatchCounts",
    "count_compiled",
    "count_dispatch",
    "is_sync_op",
    "ForeignLoad",
    "spin_load",
    "Stats",
    "TimingRun",
    "TransientMemory",
    "WrittenBytes",
    "check_device",
    "count_written_bytes",
    "page_faults",
    "probe_transient",
    "sync",
    "time_interleaved",
]
