"""SGLang's host slots as kvbank's pages (``PoolMap.blocks``): whole aligned pages only."""

from __future__ import annotations

import pytest
import torch

from tests.integrations.sglang.conftest import require_sglang

require_sglang()

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                        "ignore::UserWarning")


def test_host_slots_map_to_their_pages_and_a_slot_out_of_place_is_refused() -> None:
    from kvbank.errors import InvalidInput
    from kvbank.integrations.sglang.harness import mha_pools, storage_config
    from kvbank.integrations.sglang.pools import UnsupportedPool, pool_map

    _, _, host = mha_pools(tokens=64, page_size=4)
    pm = pool_map("kv", host, storage_config("pools-model"))
    assert pm.slot_pages == 4
    assert pm.blocks(torch.tensor([8, 9, 10, 11, 0, 1, 2, 3]), 2) == [2, 0]
    assert pm.blocks(torch.tensor([12, 13, 14, 15], dtype=torch.int32), 1) == [3]
    for bad in ([8, 9, 10, 12, 0, 1, 2, 3], [1, 2, 3, 4, 0, 1, 2, 3], [8, 9, 11, 10, 0, 1, 2, 3]):
        with pytest.raises(UnsupportedPool, match="whole aligned pages"):
            pm.blocks(torch.tensor(bad), 2)
    with pytest.raises(InvalidInput, match="slots for"):
        pm.blocks(torch.tensor([0, 1, 2]), 1)
