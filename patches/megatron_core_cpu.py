"""CPU shim for megatron-core 0.16.1: its pipeline schedules, p2p communication, global memory
buffer, param/grad buffers, optimizer and RNG tracker run on CPU with gloo.

megatron-core assumes CUDA in a handful of places (line numbers of 0.16.1):

- ``device="cuda"`` / ``torch.cuda.current_device()`` when it allocates: the global memory
  buffer (``utils.py:631``, every attention forward), the causal mask
  (``transformer/utils.py:35``), the param and grad buffers
  (``distributed/param_and_grad_buffer.py:800, 806``), the pipeline's receive buffers
  (``pipeline_parallel/p2p_communication.py:313, 321``, and ``torch.cuda.synchronize()`` at
  ``:398``), the token count of a schedule (``pipeline_parallel/schedules.py:2138``), the
  optimizer's overflow flags (``optimizer/optimizer.py:481, 485``), the grad-norm buffers
  (``optimizer/clip_grads.py:103, 174, 207``) and ``dist_checkpointing``'s save
  (``strategies/filesystem_async.py:230`` synchronizes, ``strategies/state_dict_saver.py:204,
  252`` and ``strategies/async_utils.py:165`` all-reduce CUDA tensors);
- type-name checks against ``'torch.cuda.FloatTensor'`` (``optimizer/distrib_optimizer.py:420``
  raises TypeError for a CPU parameter; ``optimizer/clip_grads.py:167`` asserts);
- the RNG tracker forks the CUDA generator (``tensor_parallel/random.py:235-238``), used by
  every dropout;
- ``weight.data.cuda()`` for tied embeddings across pipeline stages
  (``models/common/language_module/language_module.py:244``).

:func:`apply` changes, at run time and never in an installed file:

- **P1**: in the modules of :data:`P1_MODULES`, the global name ``torch`` is rebound to a proxy
  that forwards everything to torch except: the tensor factories map a CUDA ``device`` (a
  "cuda" string, an int, a cuda ``torch.device``) to the CPU, and ``torch.cuda`` is a facade
  whose ``current_device()`` is the CPU, ``synchronize``/``empty_cache`` do nothing,
  ``manual_seed`` seeds the CPU generator and streams/events are inert (CPU work is
  synchronous). Every redirect is counted by call site (:func:`redirects`). torch itself,
  and every other module's ``torch``, stay as they are.
- **P2**: the functions with the type-name checks are rebuilt from their own code with the
  CUDA type names replaced by the CPU ones; their bytecode is otherwise unchanged.
- **P3**: the RNG tracker singleton becomes a ``CudaRNGStatesTracker`` subclass that keeps the
  same named states on the CPU default generator (forked streams stay independent of the
  default stream, as they are on a GPU).
- **P4**: ``LanguageModule.setup_embeddings_and_output_layer`` is rebuilt with its one ``.cuda()``
  turned into ``.cpu()`` (a no-op on CPU tensors).

On a machine with CUDA, :func:`apply` does nothing (megatron-core then runs as released);
another megatron-core version is refused with :class:`ShimError`, since the patched lines
may have moved. tests/test_megatron_shim.py pins each changed behaviour.

    from hotspare_patches import megatron_core_cpu
    megatron_core_cpu.apply()   # before building the model
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections import Counter

import torch

SUPPORTED_VERSION = "0.16.1"

P1_MODULES = (
    "megatron.core.utils",  # GlobalMemoryBuffer.get_tensor, local_multi_tensor_l2_norm
    "megatron.core.transformer.utils",  # get_default_causal_mask
    "megatron.core.pipeline_parallel.schedules",  # the token count's tensor
    "megatron.core.pipeline_parallel.p2p_communication",  # receive buffers, synchronize
    "megatron.core.distributed.param_and_grad_buffer",  # param and grad buffers
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.optimizer",  # found_inf, the overflow buffer
    "megatron.core.optimizer.clip_grads",  # grad-norm and zero-count buffers
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.tensor_parallel.random",  # torch.cuda.manual_seed in model_parallel_cuda_manual_seed
    "megatron.core.tensor_parallel.layers",  # weight init when use_cpu_initialization is off
    # dist_checkpointing (the restart baseline's save and load): torch.cuda.synchronize() after
    # the device-to-host copies, a CUDA tensor for the async writer's liveness all-reduce.
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # the save's verify/failure all-reduces
)

TYPE_NAMES = {
    "torch.cuda.FloatTensor": "torch.FloatTensor",
    "torch.cuda.HalfTensor": "torch.HalfTensor",
    "torch.cuda.BFloat16Tensor": "torch.BFloat16Tensor",
}

_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "empty_strided", "rand", "randn")
_REDIRECTS: Counter = Counter()
_applied = False


class ShimError(RuntimeError):
    """The installed megatron-core is not the version this shim was written for."""


def redirects() -> dict[str, int]:
    """``"file:line what" -> count`` of every CUDA use the shim turned into a CPU one."""
    return {f"{f}:{n} {what}": c for (f, n, what), c in sorted(_REDIRECTS.items())}


def _count(what: str, depth: int = 2) -> None:
    """Count a redirect at the caller ``depth`` frames up (2: the caller of the function that counts)."""
    frame = sys._getframe(depth)
    _REDIRECTS[(frame.f_code.co_filename.split("site-packages/")[-1], frame.f_lineno, what)] += 1


def _is_cuda(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare int is a CUDA ordinal to torch
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _Inert:
    """A stream, event or stream context that has nothing to wait for (CPU work is synchronous)."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _Inert()

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _CudaFacade(types.ModuleType):
    """What P1's modules see as ``torch.cuda``."""

    def __init__(self):
        super().__init__("torch.cuda (hotspare CPU shim)")

    def current_device(self):
        _count("torch.cuda.current_device")
        return torch.device("cpu")

    def synchronize(self, *args, **kwargs):
        _count("torch.cuda.synchronize")

    def empty_cache(self):
        _count("torch.cuda.empty_cache")

    def manual_seed(self, seed):
        _count("torch.cuda.manual_seed")
        torch.manual_seed(seed)

    def Stream(self, *args, **kwargs):  # noqa: N802 - torch's name
        _count("torch.cuda.Stream")
        return _Inert()

    def Event(self, *args, **kwargs):  # noqa: N802 - torch's name
        _count("torch.cuda.Event")
        return _Inert()

    def stream(self, *args, **kwargs):
        _count("torch.cuda.stream")
        return contextlib.nullcontext()

    def default_stream(self, *args, **kwargs):
        _count("torch.cuda.default_stream")
        return _Inert()

    def current_stream(self, *args, **kwargs):
        _count("torch.cuda.current_stream")
        return _Inert()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchProxy(types.ModuleType):
    """What P1's modules see as ``torch``."""

    def __init__(self):
        super().__init__("torch (hotspare CPU shim)")
        self.cuda = _CudaFacade()
        for name in _FACTORIES:
            setattr(self, name, self._factory(name, getattr(torch, name)))

    @staticmethod
    def _factory(name, real):
        def make(*args, **kwargs):
            device = kwargs.get("device")
            if device is not None and _is_cuda(device):
                _count(f"torch.{name}(device={device!r})", depth=2)
                kwargs["device"] = "cpu"
            return real(*args, **kwargs)

        make.__name__ = make.__qualname__ = name
        return make

    def __getattr__(self, name):
        return getattr(torch, name)


PROXY = _TorchProxy()


def _swap_constants(code: types.CodeType, mapping: dict) -> types.CodeType:
    def fix(c):
        if isinstance(c, str):
            return mapping.get(c, c)
        if isinstance(c, tuple):
            return tuple(fix(x) for x in c)
        if isinstance(c, frozenset):
            return frozenset(fix(x) for x in c)
        if isinstance(c, types.CodeType):
            return _swap_constants(c, mapping)
        return c

    return code.replace(co_consts=tuple(fix(c) for c in code.co_consts))


def _swap_names(code: types.CodeType, mapping: dict) -> types.CodeType:
    consts = tuple(_swap_names(c, mapping) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_names=tuple(mapping.get(n, n) for n in code.co_names), co_consts=consts)


def rebuild(fn, constants: dict | None = None, names: dict | None = None):
    """``fn`` with string constants and/or attribute names swapped; same globals, defaults,
    closure (a method's ``super()`` cell survives) and attributes. The original is kept as
    ``__hotspare_original__``."""
    code = fn.__code__
    if constants:
        if not _has_constant(code, set(constants)):
            raise ShimError(f"{fn.__qualname__} has none of {sorted(constants)} any more: the shim is out of date")
        code = _swap_constants(code, constants)
    if names:
        if not set(names) <= set(code.co_names):
            raise ShimError(f"{fn.__qualname__} does not use {sorted(set(names) - set(code.co_names))} any more: "
                            f"the shim is out of date")
        code = _swap_names(code, names)
    new = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    new.__hotspare_original__ = fn
    return new


def _has_constant(code: types.CodeType, wanted: set) -> bool:
    for c in code.co_consts:
        if isinstance(c, str) and c in wanted:
            return True
        if isinstance(c, (tuple, frozenset)) and any(isinstance(x, str) and x in wanted for x in c):
            return True
        if isinstance(c, types.CodeType) and _has_constant(c, wanted):
            return True
    return False


def _cpu_rng_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """``CudaRNGStatesTracker``'s named states, kept on the CPU default generator."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            before = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(before)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            before, outer = torch.get_rng_state(), self._current_state_name
            if outer != "default-rng":
                self.states_[outer] = before
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(f"current state name {self._current_state_name} != {name}")
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(self.states_[outer] if outer != "default-rng" else before)
                self._current_state_name = outer

    return CPURNGStatesTracker


def check_version() -> str:
    """The installed megatron-core's version; :class:`ShimError` when it is not the supported one."""
    from megatron.core import package_info

    version = package_info.__version__
    if version != SUPPORTED_VERSION:
        raise ShimError(f"hotspare's megatron-core CPU shim is written for megatron-core {SUPPORTED_VERSION}, "
                        f"and {version} is installed: the lines it patches may have moved. Install "
                        f"megatron-core=={SUPPORTED_VERSION} to run the Megatron path on CPU (on a GPU no shim is "
                        f"needed), or update patches/megatron_core_cpu.py and its tests for {version}.")
    return version


def apply(force: bool = False) -> bool:
    """Patch megatron-core to run on CPU; returns whether it patched (False on a CUDA machine,
    unless ``force``, and on a second call). Call before the model is built."""
    global _applied
    if _applied or (torch.cuda.is_available() and not force):
        return False
    check_version()
    for name in P1_MODULES:
        module = importlib.import_module(name)
        if module.__dict__.get("torch") is not torch:
            raise ShimError(f"{name} does not import torch as 'torch' any more: the shim is out of date")
        module.torch = PROXY

    from megatron.core.models.common.language_module import language_module
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.tensor_parallel import random as mrandom

    dist_opt = distrib_optimizer.DistributedOptimizer
    build = dist_opt.__dict__["_build_model_and_main_param_groups"].__func__
    dist_opt._build_model_and_main_param_groups = classmethod(rebuild(build, TYPE_NAMES))
    dist_opt.__init__ = rebuild(dist_opt.__init__, TYPE_NAMES)
    f16 = moptimizer.Float16OptimizerWithFloat16Params
    f16.__init__ = rebuild(f16.__init__, TYPE_NAMES)
    clip = rebuild(clip_grads.clip_grad_by_total_norm_fp32, TYPE_NAMES)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    moptimizer.clip_grad_by_total_norm_fp32 = clip  # optimizer.py imports it by name

    mrandom._CUDA_RNG_STATE_TRACKER = _cpu_rng_tracker_class()()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # The recompute path and get_all_rng_states read and set "the CUDA state": the CPU one here.
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)

    lm = language_module.LanguageModule
    lm.setup_embeddings_and_output_layer = rebuild(lm.setup_embeddings_and_output_layer, names={"cuda": "cpu"})
    _applied = True
    return True


def applied() -> bool:
    return _applied
