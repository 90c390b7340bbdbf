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
