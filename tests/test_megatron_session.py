"""hotspare.integrations.megatron's start-up checks (in process, no process group): the
``"hotspare"`` section is validated naming the key, and a spare's lazy imports exist."""
from __future__ import annotations

import pytest

from hotspare.config import ConfigError
from hotspare.integrations import megatron


def test_the_section_is_read_from_a_mapping_or_a_dict_holding_it_and_bad_keys_are_named():
    assert megatron.parse_config(None) is None
    assert megatron.parse_config({"mirror": {"replicas": 2}}).mirror.replicas == 2
    assert megatron.parse_config({"hotspare": {"mirror": {"replicas": 2}}}).mirror.replicas == 2
    with pytest.raises(ConfigError, match="hotspare.mirror.replica"):
        megatron.parse_config({"mirror": {"replica": 2}})


def test_every_module_a_spare_imports_while_it_waits_exists_in_this_megatron_core():
    """Pins LAZY_IMPORTS against the installed megatron-core: a moved module would silently put
    its import back on the recovery's path (the spare's build after its order)."""
    from hotspare.integrations.megatron import warm_up_spare

    assert warm_up_spare() == []


def test_a_plain_optimizer_is_refused_naming_the_distributed_one():
    """megatron-core's example trains with a plain torch Adam: refused at initialize with what to
    build instead (it used to fail on every rank with an AttributeError on shard_fp32_groups)."""
    import torch

    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ConfigError, match=r"torch\.optim\.adam\.Adam.*use_distributed_optimizer=True"):
        megatron.check_optimizer(adam)
    # With hotspare off the build's optimizer is the user's business.
    assert megatron.build_checked(lambda: ([], adam, None), {}, enabled=False)[1] is adam
    with pytest.raises(ConfigError, match="distributed optimizer only"):
        megatron.build_checked(lambda: ([], adam, None), {}, enabled=True)


def test_the_missing_gloo_groups_of_get_megatron_optimizers_defaults_are_named():
    """get_megatron_optimizer's default use_gloo_process_groups=True meets hotspare's
    create_gloo_process_groups=False: the error says which argument to pass and why."""
    def build():
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group_gloo()  # what the optimizer does; asserts without the twins

    with pytest.raises(ConfigError, match="use_gloo_process_groups=False.*create_gloo_process_groups=True"):
        megatron.build_checked(build, {"create_gloo_process_groups": False}, enabled=True)


def test_after_the_alarm_a_megatron_forward_leaves_at_its_next_block(monkeypatch):
    """Issue 32: megatron-core's forward had no alarm check, so a survivor kept posting
    tensor-parallel collectives on the failed generation's groups. Every block of every chunk
    now checks before its forward; the layers without children are not hooked."""
    import torch

    from hotspare.generation import Generation
    from hotspare.integrations.megatron.session import MegatronSession
    from hotspare.recovery import GenerationFailed

    class Heartbeat:
        def watch(self, generation, alarm):
            self.alarm = alarm

    ran = []
    inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    chunks = [torch.nn.Sequential(inner, torch.nn.Linear(2, 2)), torch.nn.Sequential(torch.nn.Linear(2, 2))]
    chunks[0][1].register_forward_pre_hook(lambda m, a: ran.append("last"))
    session = MegatronSession(config=None, generation=Generation(3, 0, 2), store=None, heartbeat=Heartbeat(),
                              model=chunks, optimizer=None, scheduler=None, parallel={})
    assert set(map(id, session.interruptible())) == {id(chunks[0]), id(inner), id(chunks[1])}
    x = torch.zeros(1, 2)
    chunks[0](x)  # no alarm: the forward runs
    assert ran == ["last"]
    broke = []
    monkeypatch.setattr(session, "break_connections", lambda: broke.append(1) or 0)
    assert session.heartbeat.alarm()  # the coordinator: generation 3 failed
    assert broke == [1]
    with pytest.raises(GenerationFailed, match="generation 3 failed"):
        chunks[0](x)
    assert ran == ["last"]  # left before its first block
    with pytest.raises(GenerationFailed):
        chunks[1](x)
