"""The device an engine computes on, and everything that differs between devices, in one object.

    resolve_platform("--device") -> CPUPlatform | CUDAPlatform | SplitPlatform (tests)

The rest of the engine is one code path: it places tensors on ``platform.device``, uploads each
step's inputs through ``platform.upload`` and orders copies with the platform's streams and
events. On the CPU those are no-ops and the "device" tensor is the host tensor. On CUDA host
buffers are pinned, copies are asynchronous and events order them.

``SplitPlatform`` is the CPU stand-in for a GPU in tests (``PDSERVE_TEST_PLATFORM=split``): device
tensors are separate from host tensors, the host copy is poisoned after every upload, and copies
queued on a stream land only when an event recorded after them is waited on. Code that reads a
host buffer where it should read the device one, or reads a copy before its event, then gives
wrong tokens on the CPU, where the HF-exact tests see it. It also reports device memory, so an
engine on it sizes its pool as on a GPU: after a profile run of its largest step. Every split
platform of a process shares one emulated device (``SplitMemory``): each has its own allocator
counters, which tests move, and the device's free memory falls as any of them holds more, as
several processes on one GPU see it.

The CUDA path has not yet run on a GPU (bench/gpu_oneshot.sh checks it on the first one lent), so
``auto`` stays on the CPU and ``cuda`` starts with a warning that says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import weakref
from collections.abc import Callable

import torch

from pdserve.engine.machine.device import check_device_name

log = logging.getLogger(__name__)

TEST_PLATFORM_ENV = "PDSERVE_TEST_PLATFORM"  # "split": SplitPlatform in place of the CPU one
UNVERIFIED_CUDA = (
    "the CUDA path is built and tested on the CPU but has not yet run on a GPU "
    "(bench/gpu_oneshot.sh checks it; bench/README.md has its table once it has)"
)
POISON_BYTE = 0x7F  # int64 0x7f7f...: any index read from a poisoned buffer is far out of range
# SplitPlatform's device: this much memory, shared by every split platform of the process (its
# figures drive the GPU's sizing path, profile run included; the engine's own tensors are host
# memory and are not counted, so only what tests charge moves them)
SPLIT_DEVICE_BYTES = 16 << 30
# A process's CUDA context where NVML cannot measure it: an H100 context with cuBLAS and NCCL is
# typically 0.5 GiB (an estimate from public reports, not a measurement here), rounded up
CUDA_CONTEXT_ESTIMATE = 1 << 30


class NullStream:
    """A stream where work runs in program order (the CPU)."""

    def synchronize(self) -> None:
        pass


class NullEvent:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Platform:
    """The CPU: tensors live in host memory, copies happen when they are issued."""

    device: torch.device = torch.device("cpu")

    kind = "cpu"
    separate_host = False  # whether a device tensor is a different buffer from its host copy
    pin_memory = False

    @property
    def default_dtype(self) -> str:
        return "float32"  # checked token for token against HF in fp32

    @property
    def packs_linears(self) -> bool:
        return self.device.type == "cpu"  # oneDNN packed weights (kernels/cpu_linear.py)

    @property
    def dist_backend(self) -> str:
        """torch.distributed's backend for a tensor-parallel node's ranks (engine/executor/parallel.py)."""
        return "gloo"

    def activate(self) -> None:
        """Bind this thread to the device; every thread that launches kernels or copies calls it."""

    def mem_info(self) -> tuple[int, int] | None:
        """(free, total) bytes of device memory; None where the pool is sized from host RAM."""
        return None

    def reset_peak(self) -> None:
        pass

    def peak_bytes(self) -> int | None:
        """Most device memory torch held since ``reset_peak``; None where it is not tracked."""
        return None

    def allocated_bytes(self) -> int | None:
        """Device memory torch holds now; None where it is not tracked."""
        return None

    def peak_reserved_bytes(self) -> int | None:
        """Most device memory torch's allocator reserved since ``reset_peak`` (live tensors and
        its cache); None where it is not tracked."""
        return None

    def context_bytes(self) -> int:
        """This process's device memory outside torch's allocator (its context): charged to its
        engine's share (engine/machine/sizing.py). 0 where there is no device."""
        return 0

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def stream(self):
        return NullStream()

    def event(self):
        return NullEvent()

    def use_stream(self, stream) -> contextlib.AbstractContextManager:
        """Run the block's kernels and copies on ``stream``."""
        return contextlib.nullcontext()

    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer device copies go to or from (pinned where that makes them asynchronous)."""
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pin_memory)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream=None) -> None:
        """``dst.copy_(src)``, asynchronous where the platform allows it: the bytes are there only
        after an event recorded on ``stream`` (the current stream when None) has completed."""
        dst.copy_(src)

    def uploaded(self, host: torch.Tensor) -> None:
        """Called after ``host`` was copied to the device: nothing may read it again this step."""


@dataclasses.dataclass(frozen=True)
class CUDAPlatform(Platform):
    kind = "cuda"
    separate_host = True
    pin_memory = True

    @property
    def default_dtype(self) -> str:
        return "bfloat16"

    @property
    def dist_backend(self) -> str:
        return "nccl"

    def activate(self) -> None:
        torch.cuda.set_device(self.device)

    def mem_info(self) -> tuple[int, int] | None:
        return torch.cuda.mem_get_info(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device)

    def allocated_bytes(self) -> int | None:
        return torch.cuda.memory_allocated(self.device)

    def peak_reserved_bytes(self) -> int | None:
        return torch.cuda.max_memory_reserved(self.device)

    def context_bytes(self) -> int:
        """NVML's count of this process's memory on the device, less what the allocator holds;
        CUDA_CONTEXT_ESTIMATE where NVML cannot say (no pynvml, or a PID namespace that hides this
        process from it). Not yet checked on a GPU."""
        used = _nvml_process_bytes(self.device)
        if used is None:
            log.info(
                "%s: NVML gives no per-process count; its context taken as %d MiB",
                self.device,
                CUDA_CONTEXT_ESTIMATE >> 20,
            )
            return CUDA_CONTEXT_ESTIMATE
        return max(0, used - torch.cuda.memory_reserved(self.device))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def stream(self):
        return torch.cuda.Stream(self.device)

    def event(self):
        return torch.cuda.Event()

    def use_stream(self, stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream=None) -> None:
        with self.use_stream(stream) if stream is not None else contextlib.nullcontext():
            dst.copy_(src, non_blocking=True)


def _nvml_process_bytes(device: torch.device) -> int | None:
    """This process's bytes on ``device`` as NVML counts them (context, allocator, NCCL); None
    where NVML is missing or does not list this process."""
    try:
        import pynvml  # nvidia-ml-py; bench/gpu_oneshot.sh carries it in .whl/

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device))
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # noqa: BLE001 - no NVML here, or it refused: the estimate stands in
        return None
    used = [p.usedGpuMemory for p in processes if p.pid == os.getpid() and p.usedGpuMemory]
    return used[0] if used else None


class FakeStream:
    """A stream whose copies are queued, not done: they land when an event recorded after them is
    synchronized or waited on, as a GPU's would complete only then."""

    def __init__(self) -> None:
        self.queue: list[Callable[[], None]] = []

    def flush(self, upto: int | None = None) -> None:
        upto = len(self.queue) if upto is None else upto
        work, self.queue[:upto] = self.queue[:upto], []
        for do in work:
            do()

    def synchronize(self) -> None:
        self.flush()


class FakeEvent:
    def __init__(self, platform: SplitPlatform) -> None:
        self._platform = platform
        self._stream: FakeStream | None = None
        self._mark = 0

    def record(self, stream: FakeStream | None = None) -> None:
        self._stream = stream or self._platform.current
        self._mark = len(self._stream.queue)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.flush(self._mark)
            self._mark = 0

    def wait(self, stream=None) -> None:
        self.synchronize()  # host-side stand-in: what the waiting stream would see is now there


class SplitMemory:
    """One split platform's share of the emulated device: what its "process" holds outside the
    allocator (a CUDA context's stand-in) and in it. Tests move the allocator's counters with
    ``allocate`` and ``free``; the device's free memory is what every live SplitMemory leaves."""

    def __init__(self, context: int = 0) -> None:
        self.context = context  # bytes outside the allocator, held from the start
        self.allocated = 0  # bytes in live tensors
        self.reserved = 0  # bytes the allocator holds (live tensors and its cache)
        self.peak = 0  # most allocated since reset_peak
        self.peak_reserved = 0  # most reserved since reset_peak
        _SPLIT_TENANTS.add(self)

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated)
        self.peak = max(self.peak, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, nbytes: int) -> None:
        """Tensors freed: their bytes stay reserved (cached) until ``empty_cache``."""
        assert nbytes <= self.allocated, (nbytes, self.allocated)
        self.allocated -= nbytes

    def empty_cache(self) -> None:
        self.reserved = self.allocated

    def reset_peak(self) -> None:
        self.peak, self.peak_reserved = self.allocated, self.reserved


_SPLIT_TENANTS: weakref.WeakSet[SplitMemory] = weakref.WeakSet()  # every split platform's memory


def split_device_free() -> int:
    """The emulated device's free bytes: what no live split platform holds."""
    return SPLIT_DEVICE_BYTES - sum(m.context + m.reserved for m in _SPLIT_TENANTS)


@dataclasses.dataclass(frozen=True)
class SplitPlatform(Platform):
    """Tests only: a CPU that behaves like a GPU towards its host buffers (see the module doc).
    Work on the default stream runs at once (as kernels do in stream order); copies onto other
    streams are deferred to their events."""

    kind = "split"
    separate_host = True
    current: FakeStream = dataclasses.field(default_factory=FakeStream)
    memory: SplitMemory = dataclasses.field(default_factory=SplitMemory)

    @property
    def packs_linears(self) -> bool:
        return False  # as on a GPU: plain F.linear on the device weights

    def mem_info(self) -> tuple[int, int] | None:
        return split_device_free(), SPLIT_DEVICE_BYTES

    def reset_peak(self) -> None:
        self.memory.reset_peak()

    def peak_bytes(self) -> int | None:
        return self.memory.peak

    def allocated_bytes(self) -> int | None:
        return self.memory.allocated

    def peak_reserved_bytes(self) -> int | None:
        return self.memory.peak_reserved

    def context_bytes(self) -> int:
        return self.memory.context

    def empty_cache(self) -> None:
        self.memory.empty_cache()

    def stream(self):
        return FakeStream()

    def event(self):
        return FakeEvent(self)

    def use_stream(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream=None) -> None:
        if stream is None or stream is self.current:
            dst.copy_(src)
        else:
            src = src.clone()  # the source as it was when the copy was issued
            stream.queue.append(lambda: dst.copy_(src))

    def synchronize(self) -> None:
        self.current.flush()

    def uploaded(self, host: torch.Tensor) -> None:
        host.view(torch.uint8).fill_(POISON_BYTE)


def platform_class(name: str) -> type[Platform]:
    """The kind of platform ``resolve_platform(name)`` gives, without touching a device: what a
    node checks before it starts anything (a pool in device memory is ``separate_host``)."""
    check_device_name(name)
    if name.startswith("cuda"):
        return CUDAPlatform
    if name == "auto" and torch.cuda.is_available():
        return Platform  # auto stays on the CPU (UNVERIFIED_CUDA)
    return SplitPlatform if os.environ.get(TEST_PLATFORM_ENV) == "split" else Platform


def resolve_platform(name: str) -> Platform:
    """The platform for ``--device``; ValueError when it cannot be served here."""
    kind = platform_class(name)
    if kind is not CUDAPlatform:
        if name == "auto" and torch.cuda.is_available():
            log.warning("a CUDA device is present, but --device auto stays on the CPU: %s", UNVERIFIED_CUDA)
        return kind()
    if not torch.cuda.is_available():
        raise ValueError(f"device {name}: torch sees no CUDA device (torch.cuda.is_available() is false)")
    device = torch.device(name if ":" in name else "cuda:0")
    if device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    log.warning("device %s: %s", device, UNVERIFIED_CUDA)
    platform = CUDAPlatform(device)
    platform.activate()
    return platform


def rank_device(device: str, rank: int) -> str:
    """Tensor-parallel rank ``rank``'s device for a node's ``--device``: the CPU (or auto), or the
    r-th CUDA device from the node's first."""
    if not device.startswith("cuda"):
        return device
    first = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{first + rank}"


def check_rank_devices(device: str, tp_size: int) -> None:
    """ValueError naming the first rank whose CUDA device torch does not see, before any rank
    starts: a worker on a missing device would otherwise hold the others at the group's
    rendezvous until its timeout."""
    if not device.startswith("cuda"):
        return
    count = torch.cuda.device_count()
    for rank in range(tp_size):
        name = rank_device(device, rank)
        if int(name.split(":")[1]) >= count:
            raise ValueError(
                f"--tensor-parallel-size {tp_size} on --device {device}: rank {rank} takes {name}, "
                f"but torch sees {count} CUDA device(s)"
            )
