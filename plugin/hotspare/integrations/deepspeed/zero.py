"""What a ZeRO step cut short leaves behind, and how it goes (local to the rank): partial
gradients, reduction buckets, the backward hooks' counters, ZeRO 3's in-flight gathers and
trace. Internals pinned by tests/test_deepspeed_internals.py."""
from __future__ import annotations


def clear_interrupted_step(engine) -> None:
    """The leftovers of a step cut short: partial gradients, buckets, in-flight gathers."""
    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    _reset_backward_state(opt)
    engine._running_engine_step = False
    if stage in (1, 2):
        for bucket in opt.ipg_buckets.values():
            bucket.clear()
            bucket.index = 0
        opt.extra_large_param_to_reduce.clear()
        opt.previous_reduced_grads.clear()
        opt.params_already_reduced[:] = [False] * len(opt.params_already_reduced)
        opt.averaged_gradients.clear()
        opt.all_grad_tensors.clear()
        opt._release_ipg_buffers()
        opt.reset_partition_gradient_structures()
        opt.micro_step_id = -1
        opt.zero_grad(set_to_none=True)
        _clear_partition_grads(opt.single_partition_of_fp32_groups, getattr(opt, "cpu_offload", False))
    else:
        _reset_zero3(engine, opt)


def _clear_partition_grads(parts, offload: bool) -> None:
    """The interrupted step's gradients of the fp32 partitions. ZeRO-Offload keeps each
    partition's gradient buffer for the whole run (its backward copies into it): zeroed, not
    dropped."""
    for part in parts:
        if offload and part.grad is not None:
            part.grad.zero_()
        else:
            part.grad = None


def _reset_backward_state(opt) -> None:
    hooks = getattr(opt, "_backward_hook_state", None)
    if hooks is not None:
        hooks.reset_for_new_step()
        hooks.backward_active_depth = 0
        hooks.remaining_grad_acc_hooks = 0


def _reset_zero3(engine, opt) -> None:
    """ZeRO 3's per-step leftovers of an interrupted forward or backward."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    # Gradients left by the interrupted backward go first: DeepSpeed's zero_grad calls
    # record_stream on them, which fails on the CPU accelerator (its stream is None).
    for group in opt.fp16_groups:
        for p in group:
            p.grad = None
    opt.zero_grad(set_to_none=True)  # also resets micro_step_id and the epilogue flag
    for bucket in opt.ipg_buckets.values():
        bucket.clear_params()
    for key in opt.params_already_reduced:
        opt.params_already_reduced[key] = False
    opt.averaged_gradients.clear()
    _clear_partition_grads(opt.fp32_partitioned_groups_flat, getattr(opt, "offload_optimizer", False))
    opt._offload_boundary_param_ids = set()
    registry = getattr(engine.module, "ds_inflight_param_registry", None)
    if registry is not None:
        registry.clear()  # handles of the dead generation's all-gathers: never waited on
    for p in engine.module.parameters():
        if getattr(p, "ds_status", None) == ZeroParamStatus.INFLIGHT:
            p.ds_status = ZeroParamStatus.AVAILABLE  # partitioned again below
    del parameter_offload.FWD_MODULE_STACK[:]
    for m in engine.module.modules():
        if hasattr(m._parameters, "_in_forward"):
            m._parameters._in_forward = False
    opt.parameter_offload.get_param_coordinator().release_backward_leftovers()
