"""shard_state gives each rank tensors of its own: a cut that is a plain slice of the checkpoint tensor (the
vocabulary's rows) must not keep the whole tensor alive through a shared storage (70B at TP=4: ~3 GB a GPU)."""
import torch

from common.engine.models.sharding import Colwise, Rowwise, VocabRows, shard_state
from common.engine.parallel import TensorParallel

PLAN = {"embed_tokens": VocabRows(10), "q_proj": Colwise(), "o_proj": Rowwise()}


def test_every_share_owns_its_memory_and_equals_its_slice():
    state = {"model.embed_tokens.weight": torch.arange(40.0).view(10, 4),
             "layers.0.q_proj.weight": torch.arange(32.0).view(8, 4),
             "layers.0.o_proj.weight": torch.arange(32.0).view(4, 8)}
    for rank in range(2):
        shares = shard_state(state, PLAN, TensorParallel(rank, 2))
        for key, share in shares.items():
            whole = state[key]
            assert share.is_contiguous()
            assert share.untyped_storage().nbytes() == share.numel() * share.element_size(), key
            assert share.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr(), key
        assert torch.equal(shares["model.embed_tokens.weight"], state["model.embed_tokens.weight"][5 * rank:5 * rank + 5])
        assert torch.equal(shares["layers.0.q_proj.weight"], state["layers.0.q_proj.weight"][4 * rank:4 * rank + 4])
        assert torch.equal(shares["layers.0.o_proj.weight"], state["layers.0.o_proj.weight"][:, 4 * rank:4 * rank + 4])
