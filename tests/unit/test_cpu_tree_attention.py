"""testbed.cpu_tree_attention, the CPU stand-in for the FlashAttention-3 kernels TRL's async
trainer loads from the Hub, is a plain causal attention: alone (a segment's queries over a
longer path of keys, grouped-query heads) and inside TRL's own tree attention, on a packed
batch of TRL's own TreeRow, where every sample's logits equal a plain forward of that sample."""

from __future__ import annotations

import torch

from testbed import cpu_tree_attention


def plain_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA over one whole sequence, (len, heads, dim) in and out."""
    rep = q.shape[1] // k.shape[1]
    qh, kh, vh = (x.transpose(0, 1) for x in (q, k.repeat_interleave(rep, 1),
                                               v.repeat_interleave(rep, 1)))  # fmt: skip
    return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(
        0, 1
    )


def test_a_segment_attends_its_whole_path_causally() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, h, 8, generator=g) for h in (4, 2, 2))
    full = plain_causal(q, k, v)
    # Two segments: rows 0..7 alone, and rows 4..7 as the queries of a path of all 7 keys.
    got = cpu_tree_attention.flash_attn_varlen_func(
        torch.cat([q, q[4:]]), torch.cat([k, k]), torch.cat([v, v]),
        torch.tensor([0, 7, 10]), torch.tensor([0, 7, 14]), 7, 7, causal=True,
    )  # fmt: skip
    torch.testing.assert_close(got[:7], full)
    torch.testing.assert_close(got[7:], full[4:])


def test_trls_tree_attention_on_a_packed_batch_is_each_samples_own_forward() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.experimental.async_grpo import packing

    packing.register_tree_attention()
    assert cpu_tree_attention.install()
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    samples = [[1, 2, 3, 4, 5], [1, 2, 3, 7], [9, 8, 7]]  # two share a prefix: a tree
    row = packing.TreeRow()
    for ids in samples:
        n = len(ids)
        row.add({"input_ids": torch.tensor(ids), "completion_mask": torch.ones(n),
                 "old_log_probs": torch.zeros(n), "advantage": 0.0, "group_id": 0})  # fmt: skip
    batch = row.pack()
    assert len(batch["input_ids"]) < sum(map(len, samples))  # the shared prefix once
    model.config._attn_implementation = packing.TREE_ATTENTION
    with torch.no_grad():
        packed = model(
            input_ids=batch["input_ids"][None], position_ids=batch["position_ids"][None],
            tree_kv_index=batch["tree_kv_index"], tree_cu_seqlens_q=batch["tree_cu_seqlens_q"],
            tree_cu_seqlens_k=batch["tree_cu_seqlens_k"],
            tree_max_seqlen_q=int(batch["tree_max_seqlens"][0]),
            tree_max_seqlen_k=int(batch["tree_max_seqlens"][1]),
        ).logits[0]  # fmt: skip
        model.config._attn_implementation = "sdpa"
        for i, ids in enumerate(samples):
            alone = model(input_ids=torch.tensor([ids])).logits[0]
            # pack() scores sample i's token p off the packed position of its token p - 1:
            # token_index, in order, for every trained token (all of them here) but the first.
            where = batch["token_index"][batch["segment_id"] == i]
            torch.testing.assert_close(packed[where], alone[:-1], atol=1e-5, rtol=1e-5)
