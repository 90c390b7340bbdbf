"""patches/megatron_core_cpu.py (hotspare_patches.megatron_core_cpu): the version check and each
behaviour the shim changes, pinned in one process. The pipeline run it enables (PP=2 x DP=2,
1F1B, the distributed optimizer, bitwise reproducible) is tests/test_megatron_pipeline.py."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hotspare_patches import megatron_core_cpu as shim


@pytest.fixture(scope="module")
def applied():
    shim.apply()  # idempotent; this machine has no CUDA, so it patches
    assert shim.applied()
    return shim


def test_an_unknown_megatron_core_version_is_refused_naming_both_versions(monkeypatch):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    with pytest.raises(shim.ShimError, match=r"written for megatron-core 0\.16\.1, and 0\.17\.0 is installed"):
        shim.check_version()


def test_apply_on_an_unknown_version_patches_nothing():
    """In a process of its own: whether this one applied the shim already depends on test order."""
    code = ("from megatron.core import package_info; package_info.__version__ = '0.17.0'\n"
            "from hotspare_patches import megatron_core_cpu as shim\n"
            "try:\n    shim.apply()\nexcept shim.ShimError:\n    print('refused', shim.applied())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "refused False", proc.stdout + proc.stderr[-2000:]


def test_the_installed_version_is_the_supported_one():
    assert shim.check_version() == shim.SUPPORTED_VERSION


def test_cuda_allocations_in_the_patched_modules_land_on_the_cpu_and_torch_itself_is_untouched(applied):
    import importlib

    for name in shim.P1_MODULES:
        assert importlib.import_module(name).torch is shim.PROXY, name
    for device in ("cuda", "cuda:1", 0, torch.device("cuda", 0)):
        assert shim.PROXY.zeros(3, device=device).device.type == "cpu"
    assert shim.PROXY.zeros(3, device="cpu").device.type == "cpu" and shim.PROXY.cuda.current_device().type == "cpu"
    shim.PROXY.cuda.synchronize()
    with shim.PROXY.cuda.stream(shim.PROXY.cuda.Stream()):
        pass
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")  # the real torch still has no CUDA here

    from megatron.core.utils import GlobalMemoryBuffer

    buf = GlobalMemoryBuffer().get_tensor((4, 2), torch.float32, "attn")  # utils.py:631 allocated on cuda
    assert buf.device.type == "cpu" and buf.shape == (4, 2)
    assert any(key.startswith("megatron/core/utils.py:") for key in shim.redirects()), shim.redirects()


def test_the_type_name_checks_accept_cpu_tensors(applied):
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as moptimizer

    rebuilt = [distrib_optimizer.DistributedOptimizer.__dict__["_build_model_and_main_param_groups"].__func__,
               distrib_optimizer.DistributedOptimizer.__init__,
               moptimizer.Float16OptimizerWithFloat16Params.__init__, clip_grads.clip_grad_by_total_norm_fp32]
    for fn in rebuilt:
        assert shim._has_constant(fn.__hotspare_original__.__code__, set(shim.TYPE_NAMES)), fn.__qualname__
        assert not shim._has_constant(fn.__code__, set(shim.TYPE_NAMES)), fn.__qualname__
        assert shim._has_constant(fn.__code__, set(shim.TYPE_NAMES.values())), fn.__qualname__
    assert moptimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
    # What the rebuilt clip computes on CPU grads: the global norm, and the grads scaled by it.
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 3.0)
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=6.0)
    assert torch.allclose(p.grad, torch.full((4,), 3.0 / 6.0), atol=1e-6)


def test_the_rng_tracker_keeps_independent_named_streams_on_the_cpu_generator(applied):
    from megatron.core.tensor_parallel import random as mrandom

    assert type(mrandom.get_cuda_rng_tracker()).__name__ == "CPURNGStatesTracker"

    def draws():
        tracker = type(mrandom.get_cuda_rng_tracker())()
        tracker.add("model-parallel-rng", 1234)
        torch.manual_seed(7)
        with tracker.fork("model-parallel-rng"):
            a = torch.rand(3)
        default = torch.rand(3)  # the default stream goes on as if the fork never happened
        with tracker.fork("model-parallel-rng"):
            b = torch.rand(3)  # the named stream goes on where it stopped
        return a, b, default

    a, b, default = draws()
    torch.manual_seed(7)
    assert torch.equal(default, torch.rand(3))
    g = torch.Generator().manual_seed(1234)
    assert torch.equal(torch.cat([a, b]), torch.rand(6, generator=g))
    assert all(torch.equal(x, y) for x, y in zip(draws(), (a, b, default)))  # reproducible
    state = torch.get_rng_state()
    assert torch.equal(mrandom._get_cuda_rng_state(), state)


def test_tied_embeddings_across_stages_stay_on_the_cpu(applied):
    from megatron.core.models.common.language_module.language_module import LanguageModule

    code = LanguageModule.setup_embeddings_and_output_layer.__code__
    original = LanguageModule.setup_embeddings_and_output_layer.__hotspare_original__.__code__
    assert "cuda" in original.co_names and "cuda" not in code.co_names and "cpu" in code.co_names


def test_apply_is_a_no_op_the_second_time(applied):
    assert shim.apply() is False and shim.applied()


def test_a_rebuild_of_code_that_changed_is_refused():
    def f():
        return "nothing to swap"

    with pytest.raises(shim.ShimError, match="out of date"):
        shim.rebuild(f, shim.TYPE_NAMES)
    with pytest.raises(shim.ShimError, match="out of date"):
        shim.rebuild(f, names={"cuda": "cpu"})


DIST_CHECKPOINT = """
import sys, torch, torch.distributed as dist
from hotspare_patches import megatron_core_cpu
megatron_core_cpu.apply()
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/store", rank=0, world_size=1)
try:
    saved = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", saved)}, sys.argv[1])
    target = torch.zeros(3, 4)
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", target)}, sys.argv[1])
    assert torch.equal(loaded["w"], saved), loaded
finally:
    dist.destroy_process_group()
print("round trip ok")
"""


def test_dist_checkpointing_saves_and_loads_on_the_cpu(tmp_path):
    """The restart baseline's megatron-core checkpoint: its save synchronizes CUDA after the
    host copies and all-reduces a CUDA flag (filesystem_async, async_utils, state_dict_saver);
    with the shim both run on the CPU and the tensors round-trip."""
    import subprocess
    import sys

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    proc = subprocess.run([sys.executable, "-c", DIST_CHECKPOINT, str(ckpt)], capture_output=True, text=True,
                          timeout=240, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "round trip ok" in proc.stdout, proc.stderr[-3000:]


def test_the_first_checkpoint_save_starts_a_manager_process_hotspare_starts_early():
    """megatron-core 0.16.1's first dist_checkpointing.save spawns a multiprocessing manager (about
    3 s here) through a module-level function that keeps it; hotspare calls that function on a
    thread of its own at initialisation (megatron.warm_up_checkpoint_writer)."""
    import inspect

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    source = inspect.getsource(filesystem_async._get_write_results_queue)
    assert "global _results_queue" in source and "Manager()" in source, source
    assert hasattr(filesystem_async, "_results_queue")
